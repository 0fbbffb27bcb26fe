"""The shipped gpt and mlp search spaces fit their chain models, judged by the runtime's checks.

The service offers "detach" for a candidate only once the candidates before it cover its
upstream, so on a chain the first piece must be listed first; these tests walk the
candidates the same way (every earlier one that can be detached, detached) with the probe
alone, and check every seed plan as the engine would, so a space that would starve a
parameter or hide the paper's plan fails here, on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from erase_tune.runtime import Cut, ErasePlan, Placement, probe
from erase_tune.runtime.plan import targets_overlap
from erase_tune.workloads import get_workload

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"
PAPER = {"gpt": ("blocks.0:3", "blocks.3:5"), "mlp": ("layers.0:11", "layers.11:21")}
"""The paper's two detachment points per workload."""
GPU_SIZES = {
    "gpt": {"batch": 32, "seq_len": 256, "n_layer": 6, "n_embd": 512},
    "mlp": {"batch": 512, "width": 1024, "depth": 30, "lr": 0.001},
}


def _load(stem: str) -> dict[str, Any]:
    return yaml.safe_load((SPACES / f"{stem}.yaml").read_text())


def _probed(space: dict[str, Any]):
    # The chain's structure does not depend on the batch: probe two examples, not 512.
    wl = get_workload(space["workload"]["name"], {**space["workload"]["args"], "batch": 2})
    model = wl.build_model()
    inputs, _ = wl.example(torch.device("cpu"))
    return wl, model, probe(model, tuple(inputs), space["cuts"]["candidates"])


@pytest.mark.parametrize("stem", ["gpt", "gpt-smoke", "mlp", "mlp-smoke"])
def test_candidates_detach_in_chain_order(stem: str) -> None:
    space = _load(stem)
    wl, _, found = _probed(space)
    candidates = space["cuts"]["candidates"]
    assert space["cuts"]["modes"] == ["keep", "place", "detach"]
    # The workload's own candidates, or (smoke) an ordered selection of them.
    own = list(wl.cut_candidates)
    assert [c for c in own if c in candidates] == candidates
    assert candidates[:2] == list(PAPER[wl.name])
    greedy: list[str] = []
    for c in candidates:
        found.check_cut(c)
        found.check_placement(c)
        if any(targets_overlap(c, g) for g in greedy):
            continue
        plan = ErasePlan(cuts=tuple(Cut(module=m) for m in [*greedy, c]))
        assert found.untrained(plan) == (), f"{stem}: detaching {c} after {greedy} starves parameters"
        greedy.append(c)
    assert greedy[:2] == list(PAPER[wl.name])


@pytest.mark.parametrize("stem", ["gpt", "gpt-smoke", "mlp", "mlp-smoke"])
def test_seeds_are_no_cuts_all_placed_and_the_papers_plan(stem: str) -> None:
    space = _load(stem)
    wl, model, found = _probed(space)
    candidates, max_streams = space["cuts"]["candidates"], space["cuts"]["max_streams"]
    seeds = {s["name"]: ErasePlan.from_dict(s["plan"]) for s in space["seeds"]}
    assert len(seeds) == 3 and list(seeds)[:2] == ["no-cuts", "all-placed"]
    for plan in seeds.values():
        plan.check_model(model)
        found.check_plan(plan)
        assert plan.num_streams <= max_streams
    assert seeds["no-cuts"] == ErasePlan()
    # All placed: every candidate that does not overlap one placed before it, round-robin.
    placed: list[str] = []
    for c in candidates:
        if not any(targets_overlap(c, p) for p in placed):
            placed.append(c)
    expected = tuple(Placement(module=m, stream=1 + i % max_streams) for i, m in enumerate(placed))
    assert seeds["all-placed"].placements == expected and not seeds["all-placed"].cuts
    paper = seeds[list(seeds)[2]]
    assert [c.module for c in paper.cuts] == list(PAPER[wl.name])
    assert [c.stream for c in paper.cuts] == [1, 2] and not paper.placements


@pytest.mark.parametrize("stem", ["gpt", "gpt-smoke", "mlp", "mlp-smoke"])
def test_sizes(stem: str) -> None:
    space = _load(stem)
    name, args = space["workload"]["name"], space["workload"]["args"]
    if stem.endswith("-smoke"):
        assert space["device"] == "cpu" and space["trials"] == 8
    else:
        assert {k: args[k] for k in GPU_SIZES[name]} == GPU_SIZES[name]
