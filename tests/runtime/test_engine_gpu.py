"""EraseEngine on CUDA: float32 gradients equal the reference in every dispatch and graph mode."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from erase_tune import Cut, EraseEngine, ErasePlan
from tests.runtime.models import Toy, loss_fn, toy_batch
from tests.runtime.test_engine import engine_grads, reference_grads

pytestmark = pytest.mark.gpu

MODES = {
    "blocking": dict(dispatch="blocking"),
    "threaded": dict(dispatch="threaded"),
    "deferred": dict(dispatch="deferred"),
    "per-cut-graphs": dict(dispatch="threaded", graph=True),
    "whole-step-graph": dict(dispatch="blocking", whole_step_graph=True),
    "whole-step-graph-deferred": dict(dispatch="deferred", whole_step_graph=True),
}


def _plan(mode: str) -> ErasePlan:
    kw = dict(MODES[mode])
    graph = kw.pop("graph", False)
    cuts = (
        Cut(module="towers.0", stream=1, aux_weight=0.5, graph=graph),
        Cut(module="towers.2", stream=2, aux_weight=2.0, graph=graph),
        Cut(module="blocks.0:2", stream=1, graph=graph),
        Cut(module="towers.1", stream=0, aux_weight=0.3),
    )
    return ErasePlan(cuts=cuts, num_streams=2, **kw)


@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_gradients_equal_reference(mode):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Toy(d=64).to(dev)
    plan = _plan(mode)
    example = toy_batch(n=512, device=dev)
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=example,
                         optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    # run past warm-up and capture, so the checked step is a graph replay where graphs are on
    for step in range(6):
        inputs, target = toy_batch(n=512, seed=step, device=dev)
        before = copy.deepcopy(model)
        heads_before = {k: copy.deepcopy(h) for k, h in engine.heads.items()}
        loss = engine.step(inputs, target)
    torch.cuda.synchronize()
    ref, ref_loss = reference_grads(before, heads_before, plan, inputs, target)
    got = engine_grads(engine)
    for name, g in ref.items():
        if g is None:
            continue
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=f"{mode}: {name}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("mode", ["threaded", "per-cut-graphs", "whole-step-graph"])
def test_gpu_training_matches_eager_blocking(mode):
    """Many steps later the weights still agree with the blocking eager engine."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    base = Toy(d=64).to(dev)
    example = toy_batch(n=512, device=dev)
    engines = {}
    for m in ("blocking", mode):
        engines[m] = EraseEngine(copy.deepcopy(base), _plan(m), loss_fn=loss_fn, example=example)
    for step in range(20):
        inputs, target = toy_batch(n=512, seed=step, device=dev)
        for e in engines.values():
            e.step(inputs, target)
    torch.cuda.synchronize()
    for (n, a), (_, b) in zip(engines["blocking"].model.named_parameters(), engines[mode].model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=n)


def test_gpu_zero_cut_plan_matches_plain_loop():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    a = Toy(d=64).to(dev)
    b = copy.deepcopy(a)
    opt = torch.optim.Adam(a.parameters(), lr=1e-3)
    engine = EraseEngine(b, ErasePlan(), loss_fn=loss_fn, optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    for step in range(10):
        inputs, target = toy_batch(n=512, seed=step, device=dev)
        opt.zero_grad()
        loss_fn(a(*inputs), target).backward()
        opt.step()
        engine.step(inputs, target)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n
