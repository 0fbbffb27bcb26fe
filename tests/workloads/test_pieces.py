"""The chain workloads split into pieces as the paper does, judged by the runtime's own checks.

A cut detaches its input, so a piece whose upstream is not owned by an earlier piece starves
it. ``gpt`` and ``mlp`` put their input stage (embedding, input projection) at the head of
the chain, so the first piece owns it: the probe must accept every candidate as a cut and a
placement, detaching the first ``k`` pieces must starve nothing, detaching a later piece
alone must starve exactly what lies upstream of it, and the engine must train the paper's
two-detachment-point plan.
"""

from __future__ import annotations

import math

import pytest
import torch

from erase_tune.errors import PlanError
from erase_tune.runtime import Cut, EraseEngine, ErasePlan, Placement, probe
from erase_tune.workloads import Workload, get_workload

CPU = torch.device("cpu")
CASES = {
    "gpt": {"batch": 4, "seq_len": 32, "n_layer": 6, "n_head": 2, "n_embd": 32, "train_batches": 8, "lr": 3e-3},
    "mlp": {"batch": 64, "width": 32, "depth": 30},
}
PAPER = {"gpt": ("blocks.0:3", "blocks.3:5"), "mlp": ("layers.0:11", "layers.11:21")}
"""The paper's two detachment points: three pieces, the last one with the main loss."""


def _pieces(wl: Workload) -> list[str]:
    """The candidates that are pieces of the chain (runs), in chain order."""
    return [c for c in wl.cut_candidates if ":" in c]


def _probed(name: str, **args: object):
    wl = get_workload(name, {**CASES[name], **args})
    model = wl.build_model()
    inputs, _ = wl.example(CPU)
    return wl, model, probe(model, tuple(inputs), wl.cut_candidates)


def _cuts(*modules: str) -> ErasePlan:
    return ErasePlan(cuts=tuple(Cut(module=m, stream=1 + i % 2) for i, m in enumerate(modules)), num_streams=2)


@pytest.mark.parametrize("name", list(CASES))
def test_every_candidate_is_a_cut_and_a_placement(name: str) -> None:
    wl, _, found = _probed(name)
    for c in wl.cut_candidates:
        found.check_cut(c)
        found.check_placement(c)
    assert _pieces(wl)[:2] == list(PAPER[name])
    # Placing every piece changes no gradient, so nothing can be starved.
    placed = tuple(Placement(module=m, stream=1) for m in _pieces(wl))
    found.check_plan(ErasePlan(placements=placed, num_streams=1))


@pytest.mark.parametrize("name", list(CASES))
def test_detaching_the_first_pieces_starves_nothing(name: str) -> None:
    wl, _, found = _probed(name)
    pieces = _pieces(wl)
    assert len(pieces) == 3
    for k in range(1, len(pieces) + 1):
        plan = _cuts(*pieces[:k])
        assert found.untrained(plan) == (), pieces[:k]
        found.check_plan(plan)


def test_gpt_later_piece_alone_starves_the_embedding_and_blocks_upstream() -> None:
    _, _, found = _probed("gpt")
    upstream = (
        "blocks.0.wte.weight", "blocks.0.wpe.weight",
        "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight", "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight",
        "blocks.2.attn.qkv.weight", "blocks.2.attn.proj.weight", "blocks.2.mlp.fc.weight", "blocks.2.mlp.proj.weight",
    )  # fmt: skip
    assert found.untrained(_cuts("blocks.3:5")) == upstream
    with pytest.raises(PlanError, match=r"leaves 10 parameters untrained: blocks\.0\.wte\.weight, .*"
                                        r"\(cut 'blocks\.3:5' detaches everything upstream of it\)"):
        found.check_plan(_cuts("blocks.3:5"))
    # The second detachment point without the first, next to the last piece, starves the same.
    assert found.untrained(_cuts("blocks.3:5", "blocks.5:7")) == upstream


def test_mlp_later_piece_alone_starves_the_input_projection_and_blocks_upstream() -> None:
    _, _, found = _probed("mlp", depth=6)
    upstream = (
        "layers.0.linear.weight", "layers.0.linear.bias",
        "layers.1.linear.weight", "layers.1.linear.bias", "layers.1.norm.weight", "layers.1.norm.bias",
        "layers.2.linear.weight", "layers.2.linear.bias", "layers.2.norm.weight", "layers.2.norm.bias",
    )  # fmt: skip
    assert found.untrained(_cuts("layers.3:5")) == upstream
    # At the shipped depth: the projection and all ten blocks before the second piece.
    _, model, found = _probed("mlp")
    starved = found.untrained(_cuts("layers.11:21"))
    assert starved[:2] == ("layers.0.linear.weight", "layers.0.linear.bias")
    upstream = tuple(f"layers.{i}." for i in range(11))
    assert starved == tuple(n for n, _ in model.named_parameters() if n.startswith(upstream))
    with pytest.raises(PlanError, match=r"leaves 42 parameters untrained: layers\.0\.linear\.weight, .*"
                                        r"\(cut 'layers\.11:21' detaches everything upstream of it\)"):
        found.check_plan(_cuts("layers.11:21"))


@pytest.mark.parametrize("name", list(CASES))
def test_no_parameter_spans_a_piece_boundary(name: str) -> None:
    # A parameter shared across a detachment (an embedding tied to the head, say) would be
    # trained by two pieces' losses at once: every name a parameter goes by (ties included)
    # must lie on the same side of each piece's boundary.
    wl, model, _ = _probed(name)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    assert all(len(ns) == 1 for ns in names.values()), "a parameter is tied"
    for piece in _pieces(wl):
        prefixes = tuple(m + "." for m in Cut(module=piece).members)
        for ns in names.values():
            assert len({n.startswith(prefixes) for n in ns}) == 1, (piece, ns)
    if name == "gpt":
        assert model.lm_head.weight is not model.blocks[0].wte.weight


@pytest.mark.parametrize("name", list(CASES))
def test_engine_trains_the_two_detachment_point_plan(name: str) -> None:
    wl = get_workload(name, CASES[name])
    data = wl.make_data(CPU)
    model = wl.build_model()
    stage = "blocks.0." if name == "gpt" else "layers.0."  # the embedding, the input projection
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(stage)}
    plan = ErasePlan(cuts=(Cut(module=PAPER[name][0], stream=1), Cut(module=PAPER[name][1], stream=2)),
                     num_streams=2, dispatch="threaded")
    before = wl.normalized_entropy(model, data)
    with EraseEngine(model, plan, loss_fn=wl.loss_fn, optimizer=wl.optimizer, example=data.batch(0),
                     make_head=wl.make_head) as engine:
        assert set(engine.heads) == set(PAPER[name])
        losses = [float(engine.step(*data.batch(i))) for i in range(40)]
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert wl.normalized_entropy(model, data) < before
    # The first piece's local loss trained the input stage: every one of its tensors moved.
    named = dict(model.named_parameters())
    assert initial and all(not torch.equal(p, named[n]) for n, p in initial.items())
