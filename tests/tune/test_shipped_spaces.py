"""Every search space we ship loads and fits its workload's model (litgpt's config-hub idea)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from erase_tune.tune.checks import check_space
from erase_tune.tune.space import SearchSpace

SPACES = sorted((Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml"))


def test_the_expected_spaces_ship():
    names = {p.stem for p in SPACES}
    assert {"ctr", "gpt", "mlp", "ctr-smoke", "gpt-smoke", "mlp-smoke", "ctr-ddp"} <= names


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_shipped_space_is_valid(path):
    space = SearchSpace.load(path)
    checked = check_space(space)
    assert checked.candidates and len(checked.seeds) == len(space.seeds) >= 1
    if path.stem.endswith("-smoke"):
        assert space.device == "cpu" and space.trials == 8  # the README demo and the tests rely on it
    elif space.gpus_per_trial > 1:  # a data-parallel study: shorter (scripts/gpu_campaign.sh phase c, 240 s)
        assert space.gain_over == "graph" and space.device == "cuda" and space.trials >= 8
    else:
        assert space.gain_over == "graph" and space.trials >= 24


def test_ctr_ddp_is_the_ctr_space_on_two_ranks():
    """ctr-ddp.yaml differs from ctr.yaml only in ranks, trials, FUP on/off searched and (so that
    2 ranks still read each batch once per trial) train_batches."""
    by_name = {p.stem: SearchSpace.load(p) for p in SPACES if p.stem in ("ctr", "ctr-ddp")}
    ctr, ddp = by_name["ctr"], by_name["ctr-ddp"]
    assert (ddp.gpus_per_trial, ddp.trials, ctr.gpus_per_trial) == (2, 8, 1)
    assert (ddp.find_unused_parameters, ctr.find_unused_parameters) == ((False, True), (False,))
    steps = ddp.budget.warmup_steps + ddp.budget.windows * ddp.budget.window_steps + ddp.budget.quality_steps
    assert ddp.workload_args["train_batches"] >= 2 * steps
    same = dataclasses.replace(ddp, gpus_per_trial=1, trials=ctr.trials, source=ctr.source, text=ctr.text,
                               find_unused_parameters=ctr.find_unused_parameters,
                               workload_args={**ddp.workload_args, "train_batches": ctr.workload_args["train_batches"]})
    assert same == ctr
