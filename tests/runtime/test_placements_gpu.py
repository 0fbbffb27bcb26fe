"""Placements and lazy joins on CUDA: outputs of side-stream work are waited for where first
used (a sleeping producer makes a missing wait read garbage), writes wait for side readers,
and placements train like plain steps in every dispatch and graph mode."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from erase_tune import Cut, EraseEngine, ErasePlan, Placement
from erase_tune.runtime.join import LazyJoin
from tests.runtime.models import Toy, loss_fn, toy_batch
from tests.runtime.test_engine import engine_grads, reference_grads

pytestmark = pytest.mark.gpu

SLEEP = 20_000_000  # GPU cycles, ~10 ms: long enough for an unordered consumer to run first
CUDA = torch.device("cuda")
adam = functools.partial(torch.optim.Adam, lr=1e-3)


def _side_product(join: LazyJoin, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Stream]:
    """``2 * x`` computed late on a side stream, registered with ``join``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        y = x * 2
    done = torch.cuda.Event()
    done.record(side)
    join.add([y], [x], done, side)
    return y, side


def test_a_pending_output_is_waited_for_once_at_first_use():
    join = LazyJoin(CUDA)
    x = torch.ones(1 << 16, device=CUDA)
    y, _ = _side_product(join, x)
    with join:
        assert y.shape == x.shape and y.dtype == x.dtype  # metadata: no wait
        assert join.waits == 0
        a = y + 1
        b = torch.cat([y, y])
    assert join.waits == 1
    torch.cuda.synchronize()
    assert bool((a == 3).all()) and bool((b == 2).all())


def test_a_write_waits_for_side_readers():
    join = LazyJoin(CUDA)
    x = torch.ones(1 << 16, device=CUDA)
    y, _ = _side_product(join, x)
    with join:
        x[: 1 << 15].add_(1)  # a view of the input the side forward is still reading
    assert join.waits == 1
    torch.cuda.synchronize()
    assert bool((y == 2).all())


def test_memory_a_side_stream_reads_is_not_reused_before_release():
    join = LazyJoin(CUDA, guarded=False)
    with join:
        x = torch.ones(1 << 20, device=CUDA)
        y, _ = _side_product(join, x)  # the side stream sleeps, then reads x
        block = x.data_ptr()
        del x  # the model lets go of it: were it freed, the next allocation of its size would take it
        z = torch.full((1 << 20,), 5.0, device=CUDA)
        assert z.data_ptr() != block
    join.end_forward()
    torch.cuda.synchronize()
    join.release()
    assert bool((y == 2).all())


def test_the_runtime_s_streams_are_the_objects_current_stream_returns():
    from erase_tune.runtime import device as dev

    side = dev.new_stream(CUDA)
    with dev.use_stream(side):
        assert dev.current_stream(CUDA) is side
    assert dev.current_stream(CUDA) is dev.current_stream(CUDA)


class Sleepy(nn.Module):
    """A piece that starts late on its stream: a consumer that does not wait reads garbage."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP)
        return self.inner(x)


class Shift(nn.Module):
    """Reads its input without saving it for backward (an add)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Halving(nn.Module):
    """Halves its input in place (legal: nothing saved it), late on its stream."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP)
        x.mul_(0.5)
        return x * self.scale


class Writer(nn.Module):
    """A shared tensor read by a placed piece and by the main stream, then written in place by
    another placed piece and read again: every read must see the value program order gives."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.reader = Sleepy(Shift(d))
        self.writer = Halving(d)
        self.over = nn.Linear(4 * d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        r = self.reader(h)
        z = h + 1
        w = self.writer(h)
        return self.over(torch.cat([z, h, r, w], dim=-1)).squeeze(-1)


def _sleepy_toy() -> Toy:
    model = Toy(d=64)
    model.towers[0] = Sleepy(model.towers[0])
    return model


MODELS = {
    "toy": (_sleepy_toy, (Placement(module="towers.0", stream=1), Placement(module="towers.1", stream=2),
                          Placement(module="towers.2", stream=1), Placement(module="blocks.1:3", stream=2))),
    "writer": (Writer, (Placement(module="reader", stream=1), Placement(module="writer", stream=2))),
}
MODES = {
    "blocking": dict(dispatch="blocking"),
    "threaded": dict(dispatch="threaded"),
    "deferred": dict(dispatch="deferred"),
    "whole-step-graph": dict(whole_step_graph=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_placements_train_like_a_plain_step(name, mode):
    torch.manual_seed(0)
    build, placements = MODELS[name]
    base = build().to(CUDA)
    example = toy_batch(n=512, device=CUDA)
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=loss_fn, optimizer=adam)
    placed = EraseEngine(copy.deepcopy(base), ErasePlan(placements=placements, num_streams=2, **MODES[mode]),
                         loss_fn=loss_fn, optimizer=adam, example=example)
    for step in range(6):  # past warm-up and capture in the graph mode
        inputs, target = toy_batch(n=512, seed=step, device=CUDA)
        want, got = plain.step(inputs, target), placed.step(inputs, target)
        # float32 round-off only (capturable Adam in the graph mode rounds a little differently);
        # a missed wait reads another batch's values, off by far more
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{name}/{mode}: step {step}")
    torch.cuda.synchronize()
    for (pname, p), (_, q) in zip(plain.model.named_parameters(), placed.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4, msg=f"{name}/{mode}: {pname}")
    placed.close()


def test_placements_beside_cuts_in_a_whole_step_graph_keep_the_reference_gradients():
    torch.manual_seed(0)
    model = Toy(d=64).to(CUDA)
    model.towers[1] = Sleepy(model.towers[1])
    plan = ErasePlan(
        cuts=(Cut(module="towers.0", stream=1, aux_weight=0.5), Cut(module="blocks.0:2", stream=2)),
        placements=(Placement(module="towers.1", stream=2), Placement(module="towers.2", stream=1)),
        num_streams=2,
        whole_step_graph=True,
    )
    engine = EraseEngine(model, plan, loss_fn=loss_fn, example=toy_batch(n=512, device=CUDA), optimizer=adam)
    for step in range(6):
        inputs, target = toy_batch(n=512, seed=step, device=CUDA)
        before = copy.deepcopy(model)
        heads_before = {k: copy.deepcopy(h) for k, h in engine.heads.items()}
        loss = engine.step(inputs, target)
    torch.cuda.synchronize()
    ref, ref_loss = reference_grads(before, heads_before, plan, inputs, target)
    got = engine_grads(engine)
    for name, g in ref.items():
        assert g is not None, name
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    engine.close()


class ManyOps(nn.Module):
    """A placed tower beside a main path of many small torch calls (a host-bound forward)."""

    def __init__(self, d: int = 32, calls: int = 200) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(8, d), nn.Tanh())
        self.embed = nn.Linear(8, d)
        self.over = nn.Linear(2 * d, 1)
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tower(x)
        h = self.embed(x)
        for _ in range(self.calls):
            h = h * 0.999
        return self.over(torch.cat([h, t], dim=-1)).squeeze(-1)


def test_after_the_first_step_no_op_of_the_forward_pays_for_the_join():
    torch.manual_seed(0)
    base = ManyOps().to(CUDA)
    plan = ErasePlan(placements=(Placement(module="tower", stream=1),), num_streams=1)
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=loss_fn, optimizer=adam)
    placed = EraseEngine(copy.deepcopy(base), plan, loss_fn=loss_fn, optimizer=adam, example=toy_batch(n=64, device=CUDA))
    join = placed._join
    inputs, target = toy_batch(n=64, seed=0, device=CUDA)
    torch.testing.assert_close(placed.step(inputs, target), plain.step(inputs, target))
    first = join.ops_seen
    assert first > 200 and not join.guarded  # the first step is guarded, and showed the fast way is safe
    for step in range(1, 6):
        inputs, target = toy_batch(n=64, seed=step, device=CUDA)
        torch.testing.assert_close(placed.step(inputs, target), plain.step(inputs, target))
    assert join.ops_seen == first  # the fast way: no op of the 200-call forward went through the mode
    assert join.joins >= 6  # the tower's output was joined where it was read, every step
