"""Data-parallel ERASE on two GPUs (NCCL): float32 gradients, identical on both ranks and equal
to the single-process reference on the whole batch, in every dispatch and graph mode, with
find_unused_parameters on and off. Needs 2 CUDA devices; skipped otherwise (and on CPU).

Not run yet: no machine with two GPUs was used for this code (see docs/design.md)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import ddp_worker as w
from tests.runtime.ddp_worker import run_ranks
from tests.runtime.test_engine import reference_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

WORLD = 2
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_gpu")
    return run_ranks(WORLD, out, "cuda", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("fup", ["off", "on"])
@pytest.mark.parametrize("mode", list(w.GPU_MODES))
def test_gpu_ddp_gradients_equal_reference(ranks, mode, fup):
    case = f"{mode}-fup-{fup}"
    r0, r1 = (r[case] for r in ranks)
    for name, g in r0["grads"].items():
        assert torch.equal(g, r1["grads"][name]), (case, name)  # one all-reduce result on both ranks
    dev = torch.device("cuda", 0)
    plan = w.gpu_plan(mode, fup == "on")
    model = r0["before"].to(dev)
    heads = {k: h.to(dev) for k, h in r0["heads"].items()}
    ref, _ = reference_grads(model, heads, plan, *w.gpu_batch(w.GPU_STEPS - 1, None, WORLD, dev))
    got = {f"model.{n}": g for n, g in r0["grads"].items() if not n.startswith("head[")}
    got.update({f"head.{n[5:].split('].', 1)[0]}.{n.split('].', 1)[1]}": g
                for n, g in r0["grads"].items() if n.startswith("head[")})
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name].to(dev), g, rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")
