"""Every search space we ship loads and fits its workload's model (litgpt's config-hub idea)."""

from __future__ import annotations

from pathlib import Path

import pytest

from erase_tune.tune.driver import check_space
from erase_tune.tune.space import SearchSpace

SPACES = sorted((Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml"))


def test_the_expected_spaces_ship():
    names = {p.stem for p in SPACES}
    assert {"ctr", "gpt", "mlp", "ctr-smoke", "gpt-smoke", "mlp-smoke"} <= names


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_shipped_space_is_valid(path):
    space = SearchSpace.load(path)
    candidates, seeds = check_space(space)
    assert candidates and len(seeds) == len(space.seeds) >= 1
    if path.stem.endswith("-smoke"):
        assert space.device == "cpu" and space.trials == 8  # the README demo and the tests rely on it
    else:
        assert space.gain_over == "graph" and space.trials >= 24
