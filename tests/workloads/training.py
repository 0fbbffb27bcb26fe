"""Helpers for workload tests: a plain training loop (the loop a user writes, no engine) and the
one-line refusal every built-in gives a bad argument."""

from __future__ import annotations

import pytest
import torch

from erase_tune.errors import WorkloadError
from erase_tune.workloads import Workload, WorkloadData, get_workload


def refused(name: str, match: str, **args: object) -> str:
    """The message ``get_workload(name, args)`` refuses with: one line, naming the workload."""
    with pytest.raises(WorkloadError, match=match) as info:
        get_workload(name, args)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"workload '{name}': "), message
    return message


def train(wl: Workload, data: WorkloadData, model: torch.nn.Module, steps: int,
          optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """``steps`` optimizer steps over the workload's batches; returns the training losses."""
    opt = optimizer or wl.optimizer(model.parameters())
    losses = []
    for step in range(steps):
        inputs, target = data.batch(step)
        loss = wl.loss_fn(model(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
