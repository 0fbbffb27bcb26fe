"""Graphed pieces on CUDA: after warm-up the piece's forward and backward are CUDA-graph
replays, and gradients equal the plain step's in every dispatch mode, beside cuts and
placements, on the main stream or a side stream; a batch of another shape is one line."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from erase_tune import CaptureError, Cut, EraseEngine, ErasePlan, Graphed, Placement
from erase_tune.runtime.pieces import GraphedRunner
from tests.runtime.models import Toy, loss_fn, toy_batch
from tests.runtime.test_engine import engine_grads, reference_grads

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
adam = functools.partial(torch.optim.Adam, lr=1e-3)
GRAPHS = (Graphed(module="towers.1"), Graphed(module="blocks.2:4", stream=2))
PLANS = {
    "graphs-only": ErasePlan(graphs=GRAPHS, num_streams=2),
    "graph-on-side-stream-with-placements": ErasePlan(
        graphs=(Graphed(module="towers.0", stream=1),), placements=(Placement(module="towers.2", stream=2),),
        num_streams=2),
    "beside-cuts-blocking": ErasePlan(cuts=(Cut(module="towers.0", stream=1, aux_weight=0.5),), graphs=GRAPHS,
                                      num_streams=2, dispatch="blocking"),
    "beside-cuts-threaded": ErasePlan(cuts=(Cut(module="towers.0", stream=1, graph=True),), graphs=GRAPHS,
                                      num_streams=2, dispatch="threaded"),
    "beside-cuts-deferred": ErasePlan(cuts=(Cut(module="towers.0", stream=1),), graphs=GRAPHS, num_streams=2,
                                      dispatch="deferred"),
    "in-a-whole-step-graph": ErasePlan(cuts=(Cut(module="towers.0", stream=1),), graphs=GRAPHS, num_streams=2,
                                       whole_step_graph=True),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_graphed_pieces_keep_the_reference_gradients(name):
    torch.manual_seed(0)
    model = Toy(d=64).to(CUDA)
    plan = PLANS[name]
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=toy_batch(n=512, device=CUDA), optimizer=adam)
    for step in range(7):  # past warm-up and capture: the checked steps are replays
        inputs, target = toy_batch(n=512, seed=step, device=CUDA)
        before = copy.deepcopy(model)
        heads_before = {k: copy.deepcopy(h) for k, h in engine.heads.items()}
        loss = engine.step(inputs, target)
    torch.cuda.synchronize()
    if not plan.whole_step_graph:
        runners = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), GraphedRunner)]
        assert runners and all(r.replayed is not None for r in runners), "the pieces were captured"
    ref, ref_loss = reference_grads(before, heads_before, plan, inputs, target)
    got = engine_grads(engine)
    for pname, g in ref.items():
        assert g is not None, pname
        torch.testing.assert_close(got[pname], g, rtol=1e-5, atol=1e-6, msg=f"{name}: {pname}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    engine.close()


def test_graphed_pieces_train_like_the_plain_loop_for_many_steps():
    torch.manual_seed(0)
    base = Toy(d=64).to(CUDA)
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=loss_fn, optimizer=adam)
    graphed = EraseEngine(copy.deepcopy(base), PLANS["graphs-only"], loss_fn=loss_fn, optimizer=adam,
                          example=toy_batch(n=512, device=CUDA))
    for step in range(20):
        inputs, target = toy_batch(n=512, seed=step, device=CUDA)
        torch.testing.assert_close(graphed.step(inputs, target), plain.step(inputs, target), rtol=1e-5, atol=1e-6)
    torch.cuda.synchronize()
    for (n, p), (_, q) in zip(plain.model.named_parameters(), graphed.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=n)


def test_a_batch_of_another_shape_is_one_line_naming_the_piece():
    torch.manual_seed(0)
    engine = EraseEngine(Toy(d=64).to(CUDA), ErasePlan(graphs=(Graphed(module="towers.1"),)), loss_fn=loss_fn,
                         example=toy_batch(n=512, device=CUDA), optimizer=adam)
    for step in range(5):
        engine.step(*toy_batch(n=512, seed=step, device=CUDA))
    with pytest.raises(CaptureError) as info:
        engine.step(*toy_batch(n=256, seed=9, device=CUDA))
    message = str(info.value)
    assert "graphed piece 'towers.1'" in message and "[512, 64]" in message and "[256, 64]" in message
    assert "static shapes" in message and "\n" not in message
