"""DeepFM's branches placed on side streams inside the whole-step graph (issue 27: the bench's
"graph + placement" row failed to capture with ``fm`` placed, "operation failed due to a
previous error during capture"). ``fm`` has no parameters: nothing of its own is updated, and
its backward only reaches the shared embedding. Each single placement, captured whole, must
train as the unplaced whole-step graph does (the same mathematics: placing work on a side
stream changes no value), with and without dropout in the MLP.

The cause was not ``fm``: the bench's plans declare four side streams and use two, and the
engine made the main stream wait for all four at the step's end. A stream that never forked
from the capture cannot be waited on inside it; now only the streams a target uses are joined."""

from __future__ import annotations

import pytest
import torch

from erase_tune.measure.bench import bench_plans
from erase_tune.measure.trial import GRAPH_WARMUP, build_engine, capture_error
from erase_tune.runtime import ErasePlan, Placement
from erase_tune.workloads import get_workload

pytestmark = pytest.mark.gpu

ARGS = {"batch": 512, "num_fields": 8, "rows": 1000, "emb_dim": 8, "mlp": "32-32", "train_batches": 8,
        "eval_batches": 1}
STEPS = GRAPH_WARMUP + 4


def _train(workload, plan: ErasePlan, init, data, device) -> dict[str, torch.Tensor]:
    torch.cuda.manual_seed(0)
    engine = build_engine(workload, plan, init, data, device)
    try:
        for s in range(STEPS):
            inputs, target = data.train[s % len(data.train)]
            engine.step(inputs, target)
        torch.cuda.synchronize()
        return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    finally:
        engine.close()


@pytest.mark.parametrize("size", ["small", "bench"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("placed", ["fm", "mlp", "linear", "fm+mlp", "linear+mlp"])
def test_each_branch_placed_inside_the_whole_step_graph_trains_as_the_unplaced_graph(placed, dropout, size):
    device = torch.device("cuda")
    workload = get_workload("deepfm", {**(ARGS if size == "small" else {}), "dropout": dropout})
    torch.manual_seed(0)
    init = workload.build_model()
    data = workload.make_data(device)
    plain = _train(workload, ErasePlan(whole_step_graph=True), init, data, device)
    modules = placed.split("+")
    # two side streams more than the placements use: unused streams must not break the capture
    plan = ErasePlan(placements=tuple(Placement(module=m, stream=1 + i) for i, m in enumerate(modules)),
                     num_streams=len(modules) + 2, whole_step_graph=True)
    got = _train(workload, plan, init, data, device)
    for name, want in plain.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=f"{placed}, dropout {dropout}: {name}")


@pytest.mark.parametrize("row", ["graph + placement only", "graph + ERASE"])
def test_the_benchs_whole_step_rows_capture_on_deepfm(row):
    """The rows ``erase-tune bench --workload deepfm`` skipped: cuts (or placements) on ``linear``
    and ``mlp`` over four declared side streams, inside the whole-step graph."""
    device = torch.device("cuda")
    workload = get_workload("deepfm", {"dropout": 0.2})
    plan = bench_plans(["linear", "mlp"], 4, device)[row]
    assert plan.num_streams == 4 and {t.stream for t in plan.targets} == {1, 2}
    assert capture_error(workload, plan, device) is None
