"""DeepFM's branches placed on side streams inside the whole-step graph (issue 27: the bench's
"graph + placement" row failed to capture with ``fm`` placed, "operation failed due to a
previous error during capture"). ``fm`` has no parameters: nothing of its own is updated, and
its backward only reaches the shared embedding. Each single placement, captured whole, must
train as the unplaced whole-step graph does (the same mathematics: placing work on a side
stream changes no value), with and without dropout in the MLP."""

from __future__ import annotations

import pytest
import torch

from erase_tune.measure.trial import GRAPH_WARMUP, build_engine
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
    plan = ErasePlan(placements=tuple(Placement(module=m, stream=1 + i) for i, m in enumerate(modules)),
                     num_streams=len(modules), whole_step_graph=True)
    got = _train(workload, plan, init, data, device)
    for name, want in plain.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=f"{placed}, dropout {dropout}: {name}")
