"""``close()`` puts back exactly what the model had: the instance-level ``forward`` that
torch.compile gives a compiled module (TorchRec's ``compile_dense_path``), a user's own
instance forward, the class's forward otherwise, and every hook; a deep copy taken while the
engine is attached is the plain model too."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torchrec")

import torch
from torch import nn

from erase_tune import Cut, EraseEngine, ErasePlan
from erase_tune.runtime import Placement
from tests.torchrec.models import batch, dlrm, logits_loss, sgd, two_tower


def forwards(model: nn.Module) -> dict[str, object]:
    return {n: m.__dict__.get("forward") for n, m in model.named_modules()}


def hooks(model: nn.Module) -> dict[str, tuple]:
    return {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for n, m in model.named_modules()}


def test_close_restores_compiled_and_instance_forwards_and_hooks():
    dense, kjt, labels = batch()
    model = two_tower()
    model.dense = torch.compile(model.dense, backend="eager")  # an OptimizedModule: its forward is an instance one
    model.top[0].forward = functools_partial_forward(model.top[0])  # a user's own instance forward
    model.sparse.register_forward_hook(lambda m, a, out: out)
    want_out = model(dense, kjt)
    saved, saved_hooks = forwards(model), hooks(model)
    assert saved["dense"] is not None and saved["top.0"] is not None
    plan = ErasePlan(cuts=(Cut(module="dense"),), num_streams=1, dispatch="blocking",
                     placements=(Placement(module="sparse", stream=1), Placement(module="top.0:2", stream=1)))
    engine = EraseEngine(model, plan, loss_fn=nn.functional.binary_cross_entropy, optimizer=sgd,
                         example=((dense, kjt), labels))
    engine.step((dense, kjt), labels)
    plain = copy.deepcopy(model)  # while attached: a plain model, with the compiled forward of its own
    assert type(plain.dense.__dict__["forward"]) is type(saved["dense"])
    engine.close()
    assert forwards(model) == saved and all(forwards(model)[n] is f for n, f in saved.items())
    assert hooks(model) == saved_hooks
    assert model(dense, kjt).shape == want_out.shape  # the compiled module still runs
    assert torch.equal(plain(dense, kjt), model(dense, kjt))
    engine.close()  # twice: nothing left to restore
    assert forwards(model) == saved


def functools_partial_forward(module: nn.Module):
    """A user's own instance-level forward (as a profiler or an adapter sets one)."""
    cls_forward = type(module).forward

    def forward(x):
        return cls_forward(module, x)

    return forward


@pytest.mark.slow
def test_compile_dense_path_cuts_are_exact_and_close_keeps_the_compiled_modules():
    dense, kjt, labels = batch()
    model = dlrm()
    reference = copy.deepcopy(model)
    model.compile_dense_path(compile_mode="default")  # Inductor on the CPU
    compiled = {n: model.get_submodule(n).__dict__["forward"] for n in ("dense_arch", "inter_arch", "over_arch")}
    plan = ErasePlan(cuts=(Cut(module="dense_arch"),), dispatch="blocking")
    engine = EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels))
    engine.forward_backward((dense, kjt), labels)

    head = copy.deepcopy(engine.heads["dense_arch"])
    aux = []
    arch = reference.dense_arch
    arch.register_forward_pre_hook(lambda m, args: tuple(a.detach() for a in args))
    arch.register_forward_hook(lambda m, args, out: aux.append(logits_loss(head(out), labels)) or out.detach())
    (logits_loss(reference(dense, kjt), labels) + sum(aux)).backward()
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name.replace("dense_arch.", "dense_arch._orig_mod.")
                                       .replace("inter_arch.", "inter_arch._orig_mod.")
                                       .replace("over_arch.", "over_arch._orig_mod.")].grad, p.grad, msg=name)
    engine.close()
    for name, fwd in compiled.items():
        assert model.get_submodule(name).__dict__["forward"] is fwd, name
    assert model(dense, kjt).shape == (len(labels), 1)


def test_a_plan_named_without_the_wrappers_prefix_is_pointed_there():
    from erase_tune import PlanError

    dense, kjt, labels = batch()
    compiled = torch.compile(two_tower(), backend="eager")
    with pytest.raises(PlanError, match=r"^cuts\[0\]\.module: OptimizedModule has no submodule 'dense'; under its "
                                        r"wrapper it is '_orig_mod\.dense'$"):
        EraseEngine(compiled, ErasePlan(cuts=(Cut(module="dense"),)), loss_fn=nn.functional.binary_cross_entropy,
                    example=((dense, kjt), labels))
