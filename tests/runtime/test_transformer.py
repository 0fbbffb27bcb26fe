"""The engine on a bf16 transformer with rotary attention and value embeddings: gradients equal
the reference objective in every cut, placement and graph mode on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from erase_tune import Cut, EraseEngine, ErasePlan
from erase_tune.runtime import Graphed, Placement
from tests.runtime.test_engine import engine_grads, reference_grads
from tests.runtime.transformer import TinyGPT, gpt_batch, gpt_loss

PLANS = {
    "cuts-blocking": ErasePlan(cuts=(Cut(module="blocks.0", stream=1, aux_weight=0.5),
                                     Cut(module="blocks.2.mlp", stream=2, aux_weight=2.0)), num_streams=2),
    "cuts-threaded": ErasePlan(cuts=(Cut(module="blocks.0", stream=1), Cut(module="blocks.1.mlp", stream=2)),
                               num_streams=2, dispatch="threaded"),
    "cuts-deferred": ErasePlan(cuts=(Cut(module="blocks.0", stream=1, aux_weight=0.3),), num_streams=1,
                               dispatch="deferred"),
    "cut-graph": ErasePlan(cuts=(Cut(module="blocks.1.mlp", stream=1, graph=True),), num_streams=1),
    "placements": ErasePlan(placements=(Placement(module="blocks.0", stream=1),
                                        Placement(module="blocks.2.attn", stream=2)), num_streams=2),
    "placement-beside-cut": ErasePlan(cuts=(Cut(module="blocks.0.mlp", stream=1),),
                                      placements=(Placement(module="blocks.1", stream=2),), num_streams=2),
    "graphed": ErasePlan(graphs=(Graphed(module="blocks.1.mlp", stream=0),
                                 Graphed(module="blocks.2", stream=1)), num_streams=1),
    "whole-step-graph": ErasePlan(cuts=(Cut(module="blocks.0", stream=1),
                                          Cut(module="blocks.2.mlp", stream=1)), num_streams=1,
                                    whole_step_graph=True),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_gradients_equal_the_reference_objective_in_bf16(name):
    plan = PLANS[name]
    torch.manual_seed(0)
    model = TinyGPT()
    inputs, target = gpt_batch(8)
    pristine = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=gpt_loss, example=(inputs, target))
    try:
        loss = engine.forward_backward(inputs, target)
        ref, ref_loss = reference_grads(pristine, engine.heads, plan, inputs, target, loss=gpt_loss)
        got = engine_grads(engine)
    finally:
        engine.close()
    assert got.keys() == ref.keys()
    for key in ref:
        if ref[key] is None:
            assert got[key] is None or torch.count_nonzero(got[key]) == 0, key
            continue
        # The same bf16 operations in the same order: equal, up to float32 accumulation order.
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-7, msg=key)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    if not plan.cuts:  # nothing detached: every parameter has its plain-training gradient
        assert all(ref[k] is not None for k in ref if k.startswith("model."))


def test_the_body_really_runs_in_bf16_and_cuts_change_the_gradients():
    """The test above cannot pass for the wrong reason: the compute is bf16, and a cut's
    gradients differ from plain training's (so equality with the reference means something)."""
    model = TinyGPT()
    seen = []
    hook = model.blocks[0].mlp.up.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    inputs, target = gpt_batch(8)
    model(*inputs)
    hook.remove()
    assert seen == [torch.bfloat16]
    plain = copy.deepcopy(model)
    gpt_loss(plain(*inputs), target).backward()
    engine = EraseEngine(model, PLANS["cuts-blocking"], loss_fn=gpt_loss, example=(inputs, target))
    engine.forward_backward(inputs, target)
    engine.close()
    assert not torch.equal(model.embed.weight.grad, plain.embed.weight.grad)
