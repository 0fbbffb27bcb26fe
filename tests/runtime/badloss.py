"""Workloads with one loss mistake each, for the loss checks (erase_tune.runtime.losscheck).

``tests.runtime.badloss:workload(mistake=...)`` is the bf16 test transformer with its loss
replaced: ``none`` (per-token losses, not reduced), ``sum`` (reduction='sum'), ``shape`` (a
loss written for another output layout: it rejects the model's (B, T, V) logits), or ``ok``.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F

from erase_tune.workloads import Workload
from tests.runtime.transformer import transformer_workload

MISTAKES = {
    "ok": lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten()),
    "none": lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="none"),
    "sum": lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum"),
    "shape": lambda out, y: F.cross_entropy(out, y.flatten()),
}


def workload(mistake: str = "ok") -> Workload:
    base = transformer_workload(batch=4, seq=16, train_batches=4, eval_batches=1)
    return dataclasses.replace(base, name="tests.runtime.badloss:workload", args={"mistake": mistake},
                               loss_fn=MISTAKES[mistake])
