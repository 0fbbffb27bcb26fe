"""Graphed pieces on the CPU: the element loads and is checked like cuts and placements (one
line per mistake, before any step), and a plan of graphed pieces trains bit for bit like plain
training (on the CPU a graphed piece runs eagerly)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from erase_tune import EraseEngine, ErasePlan, Graphed, PlanError
from tests.runtime.models import Toy, loss_fn, toy_batch

adam = functools.partial(torch.optim.Adam, lr=1e-2)


def test_graphed_pieces_train_bit_for_bit_like_a_plain_step_on_the_cpu():
    torch.manual_seed(0)
    base = Toy().double()
    example = toy_batch(dtype=torch.float64)
    plan = ErasePlan(graphs=(Graphed(module="towers.0"), Graphed(module="blocks.1:3", stream=1)), num_streams=1)
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=loss_fn, optimizer=adam)
    graphed = EraseEngine(copy.deepcopy(base), plan, loss_fn=loss_fn, optimizer=adam, example=example)
    for step in range(5):
        inputs, target = toy_batch(seed=step, dtype=torch.float64)
        assert torch.equal(plain.step(inputs, target), graphed.step(inputs, target))
    for (n, p), (_, q) in zip(plain.model.named_parameters(), graphed.model.named_parameters()):
        assert torch.equal(p, q), n
    graphed.close()
    assert not any("forward" in m.__dict__ for m in graphed.model.modules())


class Odd(nn.Module):
    """Pieces a CUDA graph cannot replay: called twice, keyword and non-tensor inputs, a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Linear(4, 4)
        self.kw = nn.Linear(4, 4)
        self.flag = nn.Linear(4, 4)
        self.dict_out = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.over = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.twice(self.twice(x))
        h = self.kw.forward(input=h)
        h = _Flagged.apply_to(self.flag, h, 2)
        h = h + self.dict_out(h)
        return self.over(h).squeeze(-1)


class _Flagged:
    @staticmethod
    def apply_to(module: nn.Module, h: torch.Tensor, times: int) -> torch.Tensor:
        return module(h, times) if isinstance(module, _TakesTimes) else module(h)


class _TakesTimes(nn.Linear):
    def forward(self, x: torch.Tensor, times: int = 1) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * times


@pytest.mark.parametrize("module, needle", [
    ("twice", "is called 2 times in one forward"),
    ("kw", "takes input=; a graphed piece must take tensors only"),
    ("flag", "takes int; a graphed piece must take tensors only"),
    ("unused", "never called"),
])
def test_a_piece_a_graph_cannot_replay_is_refused_in_one_line(module, needle):
    model = Odd()
    model.flag = _TakesTimes(4, 4)
    with pytest.raises(PlanError) as info:
        EraseEngine(model, ErasePlan(graphs=(Graphed(module=module),)), loss_fn=loss_fn,
                    example=((torch.randn(8, 4),), torch.ones(8)))
    message = str(info.value)
    assert message.startswith(f"graphed piece {module!r}") and needle in message and "\n" not in message


def test_a_graphed_piece_returning_a_structure_is_refused():
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return {"h": self.inner(x)}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.piece = DictOut()
            self.over = nn.Linear(4, 1)

        def forward(self, x):
            return self.over(self.piece(x)["h"]).squeeze(-1)

    with pytest.raises(PlanError, match="returns dict; a graphed piece must return a tensor or a tuple of tensors"):
        EraseEngine(Model(), ErasePlan(graphs=(Graphed(module="piece"),)), loss_fn=loss_fn,
                    example=((torch.randn(8, 4),), torch.ones(8)))
