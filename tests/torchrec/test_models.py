"""The engine on TorchRec models (CPU): TorchRec's own DLRM and DLRM_DCN and an EBC-based
model of our own, on KeyedJaggedTensor batches. Every cut and placement computes the ERASE
objective's gradients exactly (float64, against one ordinary backward with the cuts detached
by hooks that see keyword arguments too); what cannot work is refused in one line."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torchrec")

import torch
from torch import nn

from erase_tune import Cut, EraseEngine, ErasePlan, PlanError
from erase_tune.runtime import Placement
from tests.torchrec.models import batch, dlrm, logits_loss, reference_grads, sgd, two_tower


def flat_head(name, cut_out, model_out) -> nn.Module:
    """A head for any cut output, 3-D ones too (DLRM's sparse_arch returns (B, F, D))."""
    return nn.Sequential(nn.Flatten(1), nn.Linear(math.prod(cut_out.shape[1:]), model_out.shape[-1]))


DLRM_PLANS = {
    "dense cut": ErasePlan(cuts=(Cut(module="dense_arch", aux_weight=0.5),), dispatch="blocking"),
    "dense + sparse cuts": ErasePlan(cuts=(Cut(module="dense_arch"), Cut(module="sparse_arch", aux_weight=0.3)),
                                     dispatch="threaded"),
    "deferred + placement": ErasePlan(cuts=(Cut(module="sparse_arch"),), placements=(Placement(module="inter_arch", stream=1),), num_streams=1,
                                      dispatch="deferred"),
}


def assert_exact(model, plan, inputs, target, loss_fn, **kw) -> None:
    engine = EraseEngine(model, plan, loss_fn=loss_fn, optimizer=sgd, example=(inputs, target), **kw)
    reference = reference_grads(model, inputs, target, plan, {n: h for n, h in engine.heads.items()}, loss_fn)
    engine.forward_backward(inputs, target)
    got = dict(model.named_parameters())
    for name, want in reference.named_parameters():
        g, w = got[name].grad, want.grad
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)
    engine.close()


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
@pytest.mark.parametrize("plan", DLRM_PLANS.values(), ids=DLRM_PLANS.keys())
def test_dlrm_gradients_are_exact(kind, plan):
    dense, kjt, labels = batch()
    model = dlrm(kind).double()
    assert_exact(model, plan, (dense.double(), kjt), labels.double(), logits_loss, make_head=flat_head)


def test_own_ebc_model_gradients_are_exact_and_it_trains():
    dense, kjt, labels = batch()
    plan = ErasePlan(cuts=(Cut(module="sparse"), Cut(module="dense")), dispatch="blocking")
    loss = nn.functional.binary_cross_entropy
    assert_exact(two_tower().double(), plan, (dense.double(), kjt), labels.double(), loss)

    model = two_tower()
    with EraseEngine(model, plan, loss_fn=loss, optimizer=sgd, example=((dense, kjt), labels)) as engine:
        assert engine.heads["sparse"].activation == "sigmoid"  # the default head repeats the model's sigmoid
        losses = [float(engine.step((dense, kjt), labels)) for _ in range(20)]
    assert losses[-1] < losses[0]


def refusal(model, plan, inputs, target, loss_fn, **kw) -> str:
    with pytest.raises(PlanError) as e:
        EraseEngine(model, plan, loss_fn=loss_fn, optimizer=sgd, example=(inputs, target), **kw)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_what_cannot_work_on_dlrm_is_one_line():
    dense, kjt, labels = batch()
    args = ((dense, kjt), labels, logits_loss)
    # sparse_arch returns (B, F, D): the default linear head cannot match the (B, 1) logits
    text = refusal(dlrm(), ErasePlan(cuts=(Cut(module="sparse_arch"),)), *args)
    assert text.startswith("cut 'sparse_arch': aux head maps output (8, 3, 8) to (8, 3), but the model's output is (8, 1)") and "make_head" in text
    # inter_arch takes both towers' outputs as keyword arguments: detaching it starves both
    text = refusal(dlrm(), ErasePlan(cuts=(Cut(module="inter_arch"),)), *args)
    assert text.startswith("plan leaves ") and "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight" in text
    assert "cut 'inter_arch' detaches everything upstream of it" in text
    text = refusal(dlrm(), ErasePlan(cuts=(Cut(module="over_arch"),)), *args)
    assert "produces the model's output" in text


def test_an_ebc_returns_a_keyed_tensor_not_a_cut_output():
    dense, kjt, labels = batch()
    text = refusal(two_tower(), ErasePlan(cuts=(Cut(module="sparse.ebc"),)), (dense, kjt), labels,
                   nn.functional.binary_cross_entropy)
    assert text.startswith("cut 'sparse.ebc': the module returns KeyedTensor, but a cut must return one tensor")


def test_graphed_pieces_take_the_dense_part_not_the_jagged_ids():
    from erase_tune.runtime import Graphed

    dense, kjt, labels = batch()
    text = refusal(dlrm(), ErasePlan(graphs=(Graphed(module="sparse_arch", stream=0),)), (dense, kjt), labels,
                   logits_loss)
    assert text.startswith("graphed piece 'sparse_arch': the module takes KeyedJaggedTensor; a graphed piece must take "
                           "tensors only")
    plan = ErasePlan(cuts=(Cut(module="sparse_arch"),), graphs=(Graphed(module="over_arch", stream=0),))
    with EraseEngine(dlrm(), plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                     make_head=flat_head) as engine:  # on the CPU a graphed piece runs eagerly
        assert torch.isfinite(engine.step((dense, kjt), labels))
