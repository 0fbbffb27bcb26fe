"""probe(): one forward that records targets and the gradient graph, without side effects."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from erase_tune import Cut, ErasePlan, PlanError
from erase_tune.runtime import probe
from tests.runtime.models import Toy, toy_batch

ALL_TARGETS = ["embed", "blocks.0", "blocks.0:2", "blocks.1:3", "blocks.2:4", "towers", "towers.0", "towers.1"]


def test_one_probe_serves_overlapping_targets():
    torch.manual_seed(0)
    model = Toy()
    inputs, _ = toy_batch()
    result = probe(model, inputs, ALL_TARGETS)
    model.eval()
    with torch.no_grad():
        assert torch.equal(result.model_output, model(*inputs))
        assert torch.equal(result.outputs["blocks.0:2"], model.blocks[1](model.blocks[0](torch.relu(model.embed(*inputs)))))
    assert result.outputs["towers.0"].shape == (32, 8)
    assert "towers" not in result.outputs  # a ModuleList is never called itself
    assert result.output_activation == "none"
    assert result.trainable == tuple(n for n, _ in model.named_parameters())
    for target in ALL_TARGETS[:-3]:
        result.check_cut(target)
    result.check_placement("towers.1")
    with pytest.raises(PlanError, match=r"^cut 'towers': the module is never called in Toy's forward$"):
        result.check_cut("towers")
    assert result.untrained(ErasePlan(cuts=(Cut(module="blocks.1:3"),))) == ("blocks.0.fc.weight", "blocks.0.fc.bias")
    assert result.untrained(ErasePlan(cuts=(Cut(module="blocks.0:2"), Cut(module="towers.0")))) == ()
    with pytest.raises(PlanError, match="was not among the probed targets"):
        result.check_cut("over")


def test_the_probe_leaves_no_trace():
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.frozen = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.frozen(self.bn(self.fc(x)))).sum(-1)

    model = Normed()
    model.frozen.eval()  # the user's own choice: the probe must not undo it
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    result = probe(model, toy_batch()[0], ["fc", "bn"])
    assert model.training and model.bn.training and not model.frozen.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert result.outputs["fc"].grad_fn is None  # detached: the probe's graph is released


def test_direct_forward_calls_are_seen():
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.b.forward(torch.tanh(self.a.forward(x))).squeeze(-1)

    probe(Direct(), toy_batch()[0], ["a"]).check_cut("a")


@pytest.mark.parametrize(
    "tail, activation",
    [
        (lambda y: torch.sigmoid(y).squeeze(-1), "sigmoid"),
        (lambda y: torch.softmax(y, dim=-1), "softmax"),
        (lambda y: torch.log_softmax(y, dim=1).reshape(-1, 3), "log_softmax"),
        (lambda y: torch.softmax(y, dim=0), "none"),
        (lambda y: y, "none"),
        (lambda y: torch.tanh(y), "none"),
    ],
)
def test_the_output_activation_is_read_through_views(tail, activation):
    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 3 if activation != "sigmoid" else 1)

        def forward(self, x):
            return tail(self.fc(x))

    assert probe(Tail(), toy_batch()[0], []).output_activation == activation


class _Stack(nn.Module):
    """A chain of blocks whose parent can misuse it in the ways a run forbids."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.how = how

    def forward(self, x):
        b = self.blocks
        if self.how == "twice":
            return b[2](b[1](b[1](b[0](x)))).sum(-1)
        if self.how == "skip":  # block 0's output also feeds the sum after the run
            h = b[0](x)
            return (b[2](b[1](h)) + h).sum(-1)
        if self.how == "order":
            y = b[1](x)
            return (b[2](b[0](y))).sum(-1)
        return b[2](b[1](b[0](x))).sum(-1)


@pytest.mark.parametrize(
    "how, message",
    [
        ("twice", "blocks.1 is called 2 times"),
        ("skip", "blocks.0's output is also used outside blocks.1"),
        ("order", "blocks.1 is called before blocks.0"),
        ("chain", None),
    ],
)
def test_runs_must_be_chains(how, message):
    result = probe(_Stack(how), toy_batch()[0], ["blocks.0:3", "blocks.0:2"])
    target = "blocks.0:3" if how in ("twice", "order") else "blocks.0:2"  # 0:3 ends at the output
    if message is None:
        result.check_cut(target)
        return
    with pytest.raises(PlanError, match=rf"^cut '{target}' is not a chain: {message}"):
        result.check_cut(target)


def test_a_block_called_with_more_than_the_previous_output_breaks_the_chain():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Bilinear(8, 8, 8) for _ in range(2))

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x, x), x).sum(-1)

    with pytest.raises(PlanError, match=r"blocks.1 takes more than blocks.0's output"):
        probe(Masked(), toy_batch()[0], ["blocks.0:2"]).check_cut("blocks.0:2")


def test_a_target_the_model_lacks_is_a_plan_error():
    with pytest.raises(PlanError, match=r"^target 'nope': Toy has no submodule 'nope'"):
        probe(Toy(), toy_batch()[0], ["nope"])
