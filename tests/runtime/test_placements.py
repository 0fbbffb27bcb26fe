"""Placements move work to side streams and change nothing else: on the CPU (float64) a plan
of placements trains bit for bit like plain training, and placements beside cuts leave the
cuts' gradients equal to the reference objective."""

from __future__ import annotations

import copy
import functools
import logging
import weakref

import pytest
import torch

from erase_tune import Cut, EraseEngine, ErasePlan, Placement
from erase_tune.runtime.join import LazyJoin, Pending, _tensors, _written
from tests.loglines import erase_tune_lines
from tests.runtime.models import Toy, loss_fn, toy_batch
from tests.runtime.test_engine import engine_grads, reference_grads

PLACEMENTS = (
    Placement(module="towers.0", stream=1),
    Placement(module="towers.1", stream=2),
    Placement(module="blocks.1:3", stream=1),
)
adam = functools.partial(torch.optim.Adam, lr=1e-2)


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "deferred"])
def test_placements_only_train_bit_for_bit_like_a_plain_step(dispatch):
    torch.manual_seed(0)
    base = Toy().double()
    example = toy_batch(dtype=torch.float64)
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=loss_fn, optimizer=adam)
    placed = EraseEngine(copy.deepcopy(base), ErasePlan(placements=PLACEMENTS, num_streams=2, dispatch=dispatch),
                         loss_fn=loss_fn, optimizer=adam, example=example)
    for step in range(5):
        inputs, target = toy_batch(seed=step, dtype=torch.float64)
        for e in (plain, placed):
            e.zero_grad()
        a, b = plain.forward_backward(inputs, target), placed.forward_backward(inputs, target)
        assert torch.equal(a, b), step
        for (name, p), (_, q) in zip(plain.model.named_parameters(), placed.model.named_parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        plain.optimizer.step()
        placed.optimizer.step()
    for (name, p), (_, q) in zip(plain.model.named_parameters(), placed.model.named_parameters()):
        assert torch.equal(p, q), name
    assert placed.heads == {}
    placed.close()


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "deferred"])
def test_placements_beside_cuts_keep_the_reference_gradients(dispatch):
    torch.manual_seed(0)
    model = Toy().double()
    plan = ErasePlan(
        cuts=(Cut(module="towers.0", stream=1, aux_weight=0.5), Cut(module="blocks.0:2", stream=2, aux_weight=2.0)),
        placements=(Placement(module="towers.1", stream=2), Placement(module="blocks.2:4", stream=1)),
        num_streams=2,
        dispatch=dispatch,
    )
    inputs, target = toy_batch(dtype=torch.float64)
    pristine = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=(inputs, target))
    loss = engine.forward_backward(inputs, target)
    ref, ref_loss = reference_grads(pristine, engine.heads, plan, inputs, target)
    got = engine_grads(engine)
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        assert g is not None, name
        torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    engine.close()


def test_outside_a_step_and_after_close_the_model_is_its_own():
    torch.manual_seed(0)
    model = Toy()
    inputs, target = toy_batch()
    with torch.no_grad():
        before = model(*inputs)
    engine = EraseEngine(model, ErasePlan(placements=PLACEMENTS, num_streams=2), loss_fn=loss_fn,
                         example=(inputs, target))
    with torch.no_grad():
        assert torch.equal(model(*inputs), before)
        assert torch.equal(copy.deepcopy(model)(*inputs), before)
    engine.close()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_what_the_lazy_join_sees_as_read_and_written():
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    assert list(_tensors((a, [b, 1], {"x": c}), {"out": a})) == [a, b, c, a]
    assert _written(torch.Tensor.add_, (a, b), {}) == [a]
    assert _written(torch.Tensor.__setitem__, (a, 0, 1.0), {}) == [a]
    assert _written(torch.Tensor.__iadd__, (a, b), {}) == [a]
    assert _written(torch.add, (a, b), {"out": c}) == [c]
    assert _written(torch.nn.functional.relu, (a,), {"inplace": True}) == [a]
    assert _written(torch.nn.functional.relu, (a,), {"inplace": False}) == []
    assert _written(torch.Tensor.__add__, (a, b), {}) == []


def test_the_lazy_join_bookkeeping_on_the_cpu():
    # On the CPU every stream is None: nothing waits for a tensor from the same stream, but a
    # write to the input of side work is still seen (and would wait on CUDA).
    join = LazyJoin(torch.device("cpu"))
    x = torch.ones(8)
    y = x * 2
    join.add([y], [x], done=None, stream=None)
    with join:
        z = y + 1
        x[:4].add_(1)  # a view of a side input: same storage
        _ = x.shape
    assert join.waits == 1 and torch.equal(z, torch.full((8,), 3.0))
    join.clear()
    with join:
        x.add_(1)
    assert join.waits == 1


# -- the fast way: only readers of pending outputs pay; writes found by version counters -------------


def test_the_first_forward_is_guarded_and_a_clean_one_makes_the_join_fast():
    join = LazyJoin(torch.device("cpu"))
    assert join.guarded and not join.verified
    x = torch.ones(4)
    with join:
        (y,) = join.add([x * 2], [x], done=None, stream=None)
        _ = y + 1
    join.clear()
    assert join.verified and not join.guarded and join.hazards == 0
    with join:  # fast: the output handed on is a Pending alias; reading it joins, once per stream
        (y,) = join.add([x * 2], [x], done=None, stream=None)
        assert isinstance(y, Pending)
        a, b = y + 1, torch.cat([y, y])
        assert type(a) is torch.Tensor and type(b) is torch.Tensor  # results are plain tensors
        _ = y.shape, y.dtype  # metadata: no join
    assert join.joins == 2 and torch.equal(a, torch.full((4,), 3.0)) and not join.guarded


def test_a_guarded_forward_that_sees_a_write_to_a_side_input_stays_guarded():
    join = LazyJoin(torch.device("cpu"))
    x = torch.ones(4)
    with join:
        join.add([x * 2], [x], done=None, stream=None)
        x.add_(1)
    join.clear()
    assert join.verified and join.guarded and join.hazards == 1


def test_the_fast_way_switches_back_to_guarded_on_a_write_it_finds():
    join = LazyJoin(torch.device("cpu"), guarded=False)
    x = torch.ones(4)
    with erase_tune_lines(logging.WARNING) as seen:
        with join:
            join.add([x * 2], [x], done=None, stream=None)
            x.mul_(3)  # the fast way does not see this as it happens: the version counter does, at the end
        join.clear()
    assert join.guarded and join.hazards == 1
    assert any("checked op by op" in line for line in seen)
    # a side forward that writes its own input switches at once: later readers of it must wait
    fast = LazyJoin(torch.device("cpu"), guarded=False)
    with fast:
        fast.add([x * 2], [x], done=None, stream=None, written=[x])
        assert fast.guarded and fast._mode_on
        _ = x + 1  # the mode sees this read of the written input
    assert fast.joins >= 1 and not fast._mode_on


def test_gradients_flow_through_a_pending_alias():
    join = LazyJoin(torch.device("cpu"), guarded=False)
    x = torch.ones(3, requires_grad=True)
    with join:
        (y,) = join.add([x * 2], [], done=None, stream=None)
        (y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 6.0))


def test_a_pending_alias_is_plain_once_the_forwards_stream_waited_for_it():
    join = LazyJoin(torch.device("cpu"), guarded=False)
    x = torch.ones(4)
    with join:
        (y,) = join.add([x * 2], [x], done=None, stream=None)
        assert type(y) is Pending
        a = y + 1  # the forward's own stream reads it: joined, and the alias is a plain tensor from now on
        assert type(y) is torch.Tensor
        b = y * 2
    assert join.joins == 1 and torch.equal(a, torch.full((4,), 3.0)) and torch.equal(b, torch.full((4,), 4.0))


def test_what_crossed_streams_is_held_until_release():
    join = LazyJoin(torch.device("cpu"), guarded=False)
    x = torch.ones(4)
    with join:
        (y,) = join.add([x * 2], [x], done=None, stream=None)
    seen_x, seen_y = weakref.ref(x), weakref.ref(y)
    del x, y
    join.end_forward()  # the forward's bookkeeping is gone, its tensors are not: side work may still read them
    assert seen_x() is not None and seen_y() is not None
    join.release()
    assert seen_x() is None and seen_y() is None
