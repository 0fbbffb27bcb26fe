"""Every built-in workload trains on CUDA under each way of running ERASE (streams, threads,
per-cut graphs, whole-step graph), and graph replays match the eager engine's weights.

The chain workloads (gpt, mlp) run the paper's cut plan, two detachment points: their first
piece holds the input stage (embedding, input projection), so no parameter is starved. They
also run their three pieces as placements (no detachment). ctr detaches up to three disjoint
subarchs among its candidates."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from erase_tune.measure.bench import disjoint_cuts
from erase_tune.errors import PlanError
from erase_tune.runtime import Cut, EraseEngine, ErasePlan, Placement, probe
from erase_tune.workloads import get_workload

pytestmark = pytest.mark.gpu

SMALL = {
    "ctr": {"batch": 512, "width": 64, "emb_dim": 16, "rows": 1000},
    # Six blocks: the paper's two detachment points leave two blocks with the main loss.
    "gpt": {"batch": 8, "seq_len": 64, "n_layer": 6, "n_embd": 64},
    "mlp": {"batch": 256, "width": 64},
}
PAPER = {"gpt": ("blocks.0:3", "blocks.3:5"), "mlp": ("layers.0:11", "layers.11:21")}
"""The paper's two detachment points (three pieces, the last with the main loss)."""
CASES = [("ctr", "cuts"), ("gpt", "cuts"), ("mlp", "cuts"), ("gpt", "placements"), ("mlp", "placements")]


def _ctr_cuts(workload, model, example) -> list[str]:
    """Up to three disjoint candidates that the plan checker accepts together as cuts."""
    candidates = disjoint_cuts(workload.cut_candidates)
    result = probe(model, example[0], candidates)
    cuts: list[str] = []
    for c in candidates:
        try:
            result.check_plan(ErasePlan(cuts=tuple(Cut(module=m) for m in [*cuts, c])))
        except PlanError:
            continue
        cuts.append(c)
    return cuts[:3]


def _plans(pieces, kind):
    def erase(**kw):
        graph = kw.pop("graph", False)
        if kind == "cuts":
            cuts = tuple(Cut(module=c, stream=1 + i % 2, graph=graph) for i, c in enumerate(pieces))
            return ErasePlan(cuts=cuts, num_streams=2, **kw)
        placed = tuple(Placement(module=c, stream=1 + i % 2) for i, c in enumerate(pieces))
        return ErasePlan(placements=placed, num_streams=2, **kw)

    plans = {
        "blocking": erase(dispatch="blocking"),
        "threaded": erase(dispatch="threaded"),
        "per-cut graphs": erase(dispatch="threaded", graph=True),
        "whole-step graph": erase(whole_step_graph=True),
    }
    if kind == "placements":  # dispatch and per-cut graphs concern cuts only
        del plans["threaded"], plans["per-cut graphs"]
    return plans


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_workload_trains_under_every_mode(name, kind):
    workload = get_workload(name, SMALL[name])
    dev = torch.device("cuda")
    data = workload.make_data(dev)
    init = workload.build_model()
    if name == "ctr":
        pieces = _ctr_cuts(workload, copy.deepcopy(init).to(dev), data.batch(0))
        assert pieces, workload.cut_candidates
    elif kind == "cuts":
        pieces = list(PAPER[name])
    else:
        pieces = [c for c in workload.cut_candidates if ":" in c]  # the three pieces
        assert len(pieces) == 3 and pieces[:2] == list(PAPER[name])
    weights = {}
    for mode, plan in _plans(pieces, kind).items():
        torch.manual_seed(0)
        model = copy.deepcopy(init).to(dev)
        engine = EraseEngine(model, plan, loss_fn=workload.loss_fn, optimizer=workload.optimizer,
                             example=data.batch(0), make_head=workload.make_head)
        losses = [float(engine.step(*data.batch(i))) for i in range(12)]
        engine.close()
        if engine.capture_retries:
            warnings.warn(f"{name}/{mode}: whole-step capture needed {engine.capture_retries} retry", stacklevel=1)
        assert all(torch.isfinite(torch.tensor(losses))), (mode, losses)
        weights[mode] = [p.detach().clone() for p in model.parameters()]
    # Same math in every mode: after 12 Adam steps the weights agree up to float noise
    # (atomics in embedding backward are not bitwise deterministic), measured over all weights.
    ref = torch.cat([w.flatten() for w in weights["blocking"]])
    for mode in weights:
        got = torch.cat([w.flatten() for w in weights[mode]])
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 1e-3, f"{name}/{kind}: {mode} drifted from blocking by {rel:.2e}"


def two_stream_cuts():
    """The small ctr workload with three cuts on streams 1, 2, 1: its plans (``_plans(..., "cuts")``)
    and ``weights(plan)``, every weight after 12 steps from the same start, each step waited for
    (also the set-up of the benchmark case graph_drift, recorded with scripts/per_cut_graph_drift.py)."""
    workload = get_workload("ctr", SMALL["ctr"])
    dev = torch.device("cuda")
    data = workload.make_data(dev)
    init = workload.build_model()
    pieces = _ctr_cuts(workload, copy.deepcopy(init).to(dev), data.batch(0))

    def weights(plan):
        torch.manual_seed(0)
        model = copy.deepcopy(init).to(dev)
        engine = EraseEngine(model, plan, loss_fn=workload.loss_fn, optimizer=workload.optimizer,
                             example=data.batch(0), make_head=workload.make_head)
        for i in range(12):
            float(engine.step(*data.batch(i)))  # as measured: each step waited for (0.0 under 9a8fc92)
        engine.close()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    return _plans(pieces, "cuts"), weights


def test_per_cut_graphs_on_two_streams_replay_exactly_like_blocking():
    """Three cuts on streams 1, 2, 1, each with its own CUDA graph, replayed side by side: the same
    weights as blocking, exactly, three times over (graphs captured on one stream share its cuBLAS
    workspace; two of them replaying at once on two streams would race on it)."""
    plans, weights = two_stream_cuts()
    ref = weights(plans["blocking"])
    for _ in range(3):
        assert torch.equal(weights(plans["per-cut graphs"]), ref)
