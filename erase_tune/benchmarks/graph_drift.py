"""Per-cut graphs against blocking on the small ctr workload (three cuts on streams 1, 2, 1):
the weights after 12 steps, relative drift, three repetitions, with one change at a time (D:
aliases instead of the class swap; E: record_stream of inputs; F/G: a sync after / before
replayed cuts), then as shipped. Exact (0.0) is right; see docs/benchmarks.md 00.7 and 00.8.

    python -m erase_tune.benchmarks graph_drift --out DIR

(recorded with scripts/per_cut_graph_drift.py, now this case.) Its set-up is the GPU test's
(tests/runtime/test_workloads_gpu.py: two_stream_cuts), so it runs from a checkout.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from erase_tune.benchmarks.case import ROOT, Context, case
from erase_tune.runtime import join as joinmod
from erase_tune.runtime import pieces as pc


@dataclasses.dataclass
class Options:
    pass


def _drift_without_class_swap(drift: Callable[[str], None]) -> None:
    """Drift with LazyJoin.add patched never to swap a joined tensor's class (aliases only)."""
    Tensor = torch.Tensor  # noqa: F841 - the patched add's source names it
    add_src = textwrap.dedent(inspect.getsource(joinmod.LazyJoin.add)).replace("if type(t) is Tensor:", "if False:")
    ns = {}
    exec(add_src, {**joinmod.__dict__}, ns)
    with mock.patch.object(joinmod.LazyJoin, "add", ns["add"]):
        drift("D: aliases, no class swap")


def _drift_with_record_stream(drift: Callable[[str], None]) -> None:
    """Drift with LazyJoin.add recording its inputs on the join's stream first."""
    orig_add = joinmod.LazyJoin.add

    def add_rs(self, outputs, inputs, done, stream, written=()):
        inputs = list(inputs)
        for t in inputs:
            if stream is not None:
                t.record_stream(stream)
        return orig_add(self, outputs, inputs, done, stream, written)

    with mock.patch.object(joinmod.LazyJoin, "add", add_rs):
        drift("E: record_stream of inputs")


def _drift_with_synced_replays(drift: Callable[[str], None]) -> None:
    """Drift with a device synchronize after, then before, every replayed cut."""
    orig_call = pc.CutRunner.__call__

    def synced_replay(self, *a, **k):
        out = orig_call(self, *a, **k)
        if self.graph is not None:
            torch.cuda.synchronize()
        return out

    def synced_before(self, *a, **k):
        if self.graph is not None:
            torch.cuda.synchronize()
        return orig_call(self, *a, **k)

    with mock.patch.object(pc.CutRunner, "__call__", synced_replay):
        drift("F: sync after replayed cuts only")
    with mock.patch.object(pc.CutRunner, "__call__", synced_before):
        drift("G: sync before replayed cuts only")


@case("graph_drift", Options, cuda="required", recorded_with="scripts/per_cut_graph_drift.py",
      description="per-cut CUDA graphs against blocking: relative weight drift after 12 steps (0.0 is right)",
      figures=("00.7 A lean join (the race found)", "00.8 The lean join verified and shipped (the race is gone)"))
def graph_drift(_: Options, ctx: Context) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.runtime.test_workloads_gpu import two_stream_cuts

    plans, run = two_stream_cuts()
    ref = run(plans["blocking"])
    rows: dict[str, list[float]] = {}

    def drift(tag):
        out = []
        for rep in range(3):
            w = run(plans["per-cut graphs"])
            out.append(float((w - ref).norm() / ref.norm()))
        rows[tag] = out
        print(f"{tag:<40}", [f"{d:.1e}" for d in out], flush=True)

    _drift_without_class_swap(drift)
    _drift_with_record_stream(drift)
    _drift_with_synced_replays(drift)
    drift("as is, again")
    return {"relative_drift": rows,
            "table": "\n".join(f"{tag:<40} " + " ".join(f"{d:.1e}" for d in ds) for tag, ds in rows.items())}
