"""EraseEngine: gradients equal the reference objective in every mode; zero cuts = plain training."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from erase_tune import Cut, EraseEngine, ErasePlan, PlanError
from tests.runtime.models import Toy, loss_fn, toy_batch

CUTS = (
    Cut(module="towers.0", stream=1, aux_weight=0.5),
    Cut(module="towers.2", stream=2, aux_weight=2.0, graph=True),
    Cut(module="blocks.0:2", stream=1, aux_weight=1.0),
)


def reference_grads(model, heads, plan, inputs, target, loss=loss_fn):
    """One ordinary backward of L_main + Σ λ ℓ_i with stop-gradients at the cuts.

    Written independently of the engine: forward hooks on an unpatched copy of the model.
    Placements are ignored: they change no gradient.
    """
    model = copy.deepcopy(model)
    heads = {name: copy.deepcopy(h) for name, h in heads.items()}
    modules = dict(model.named_modules())
    aux, hooks = [], []
    for cut in plan.cuts:
        first, last = modules[cut.members[0]], modules[cut.members[-1]]

        def pre(module, args, _=None):
            return tuple(a.detach() for a in args)

        def post(module, args, out, cut=cut):
            aux.append(cut.aux_weight * loss(heads[cut.name](out), target))
            return out.detach()

        hooks += [first.register_forward_pre_hook(pre), last.register_forward_hook(post)]
    total = loss(model(*inputs), target)
    total = total + sum(aux)
    total.backward()
    grads = {f"model.{n}": p.grad for n, p in model.named_parameters()}
    for name, h in heads.items():
        grads.update({f"head.{name}.{n}": p.grad for n, p in h.named_parameters()})
    return grads, total.detach()


def engine_grads(engine):
    grads = {f"model.{n}": p.grad for n, p in engine.model.named_parameters()}
    for name, h in engine.heads.items():
        grads.update({f"head.{name}.{n}": p.grad for n, p in h.named_parameters()})
    return grads


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "deferred"])
def test_gradients_equal_reference_float64(dispatch):
    torch.manual_seed(0)
    model = Toy().double()
    cuts = CUTS if dispatch != "deferred" else tuple(c.__class__(module=c.module, stream=c.stream, aux_weight=c.aux_weight) for c in CUTS)
    plan = ErasePlan(cuts=cuts, num_streams=2, dispatch=dispatch)
    inputs, target = toy_batch(dtype=torch.float64)
    pristine = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=(inputs, target))
    loss = engine.forward_backward(inputs, target)
    ref, ref_loss = reference_grads(pristine, engine.heads, plan, inputs, target)
    got = engine_grads(engine)
    assert got.keys() == ref.keys()
    for name in ref:
        if ref[name] is None:
            assert got[name] is None or torch.count_nonzero(got[name]) == 0, name
            continue
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    engine.close()


def test_cut_parameters_get_only_their_local_gradient():
    """No gradient crosses a cut: the tower's grads do not change when the main loss changes."""
    torch.manual_seed(0)
    inputs, target = toy_batch(dtype=torch.float64)
    model = Toy().double()
    plan = ErasePlan(cuts=(Cut(module="towers.1"),))
    results = []
    for scale in (1.0, 5.0):
        m = copy.deepcopy(model)
        engine = EraseEngine(m, plan, loss_fn=lambda o, y, s=scale: s * loss_fn(o, y), example=(inputs, target))
        engine.forward_backward(inputs, target)
        results.append((m.towers[1][0].weight.grad.clone(), m.over.weight.grad.clone()))
        engine.close()
    # the tower's own loss is scaled too (same loss_fn), so compare against the head's share only
    assert not torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[1][0], 5.0 * results[0][0])


def test_zero_cut_plan_is_plain_training_bit_for_bit():
    torch.manual_seed(0)
    a = Toy()
    b = copy.deepcopy(a)
    opt = torch.optim.Adam(a.parameters(), lr=1e-2)
    engine = EraseEngine(b, ErasePlan(), loss_fn=loss_fn, optimizer=functools.partial(torch.optim.Adam, lr=1e-2))
    for step in range(20):
        inputs, target = toy_batch(seed=step)
        opt.zero_grad()
        plain = loss_fn(a(*inputs), target)
        plain.backward()
        opt.step()
        got = engine.step(inputs, target)
        assert torch.equal(plain.detach(), got)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "deferred"])
def test_training_reduces_loss(dispatch):
    torch.manual_seed(0)
    model = Toy()
    cuts = tuple(Cut(module=c.module, stream=c.stream, aux_weight=c.aux_weight, graph=c.graph and dispatch != "deferred") for c in CUTS)
    plan = ErasePlan(cuts=cuts, num_streams=2, dispatch=dispatch)
    inputs, target = toy_batch(n=256)
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=(inputs, target),
                         optimizer=functools.partial(torch.optim.Adam, lr=1e-2))
    first = float(engine.step(inputs, target))
    for _ in range(60):
        last = float(engine.step(inputs, target))
    assert last < 0.7 * first
    engine.close()


def test_heads_and_parameters():
    torch.manual_seed(0)
    model = Toy()
    inputs, target = toy_batch()
    plan = ErasePlan(cuts=CUTS, num_streams=2)
    twin = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=(inputs, target))
    assert set(engine.heads) == {"towers.0", "towers.2", "blocks.0:2"}
    params = list(engine.parameters())
    assert len(params) == len(list(model.parameters())) + 3 * 2
    assert all(any(p is q for q in params) for p in engine.heads["towers.0"].parameters())
    # same head initialisation in every engine (baseline/candidate comparisons rely on it)
    other = EraseEngine(twin, plan, loss_fn=loss_fn, example=(inputs, target))
    assert torch.equal(other.heads["towers.0"].proj.weight, engine.heads["towers.0"].proj.weight)


def test_eval_forward_and_close_restore_the_model():
    torch.manual_seed(0)
    model = Toy()
    inputs, target = toy_batch()
    with torch.no_grad():
        before = model(*inputs)
    engine = EraseEngine(model, ErasePlan(cuts=CUTS, num_streams=2), loss_fn=loss_fn, example=(inputs, target))
    with torch.no_grad():
        assert torch.equal(model(*inputs), before)  # outside a step the model is unchanged
    engine.close()
    assert "forward" not in model.blocks[2].__dict__ and "forward" not in model.towers[0].__dict__


def test_bad_plans_for_the_model():
    model = Toy()
    inputs, target = toy_batch()
    with pytest.raises(PlanError, match="no submodule 'towers.9'"):
        EraseEngine(model, ErasePlan(cuts=(Cut(module="towers.9"),)), loss_fn=loss_fn, example=(inputs, target))
    with pytest.raises(PlanError, match="needs example"):
        EraseEngine(model, ErasePlan(cuts=(Cut(module="towers.0"),)), loss_fn=loss_fn)
    with pytest.raises(PlanError, match="pass make_head"):
        EraseEngine(model, ErasePlan(cuts=(Cut(module="towers.0"),)), loss_fn=loss_fn, example=(inputs, target),
                    make_head=lambda name, out, model_out: torch.nn.Linear(out.shape[-1], 3))


def test_deepcopy_of_an_attached_model_is_a_plain_model():
    torch.manual_seed(0)
    model = Toy()
    inputs, target = toy_batch()
    engine = EraseEngine(model, ErasePlan(cuts=CUTS, num_streams=2), loss_fn=loss_fn, example=(inputs, target))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(clone(*inputs), model(*inputs))
    # the clone trains like an unattached model: gradients flow through every tower and block
    loss_fn(clone(*inputs), target).backward()
    assert clone.towers[0][0].weight.grad is not None and clone.embed.weight.grad.abs().sum() > 0
    engine.close()
