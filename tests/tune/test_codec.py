"""The bound space: a space file read into one typed, nested schema, bound once by check_space,
whose codec turns Optuna parameters into plans and back."""

from __future__ import annotations

import dataclasses

import numpy as np
import optuna
import pytest

from erase_tune.runtime import ErasePlan
from erase_tune.measure.trial import Budget
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import AuxWeight, Candidate, SamplerSpec, SearchSpace, SpaceError, WorkloadSpec
from tests.tune.test_space import CANDIDATES, SPACE


def test_a_space_is_typed_and_nested():
    s = SearchSpace.loads(SPACE.replace("subarchs.3]", "{module: subarchs.3, modes: [keep, place]}]"),
                          source="t.yaml")
    assert s.source == "t.yaml" and s.text.startswith("\nworkload:")
    assert s.workload == WorkloadSpec(name="ctr", args={"batch": 64})
    assert [c.module for c in s.cuts.candidates] == CANDIDATES and list(s.cuts.modules) == CANDIDATES
    assert s.cuts.candidates[3] == Candidate("subarchs.3", ("keep", "place"))
    assert s.cuts.candidates[0].modes is None and s.cuts.aux_weight == AuxWeight(0.1, 2.0, True)
    assert s.cuts.own_modes("subarchs.3") == ("keep", "place") and s.cuts.own_modes("subarchs.0") is None
    assert s.sampler == SamplerSpec("random", 3)
    assert isinstance(s.budget.per_trial, Budget) and s.budget.timeout_s == 60 and s.trials == 8
    assert [x.name for x in s.seeds] == ["no-cuts", "all", "placed"] and isinstance(s.seeds[1].plan, ErasePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.trials = 9  # type: ignore[misc]
    assert s == SearchSpace.loads(s.text, source="t.yaml")
    changed = s.with_budget(quality_scale=3)
    assert changed.budget.per_trial.quality_scale == 3 and changed.budget.timeout_s == s.budget.timeout_s
    assert dataclasses.replace(changed, budget=s.budget) == s


def test_file_errors_are_one_space_error_line():
    with pytest.raises(SpaceError, match=r"^t.yaml: cuts.max_streams: -1 must be an integer in 0..64$"):
        SearchSpace.loads(SPACE.replace("max_streams: 3", "max_streams: -1"), source="t.yaml")


def test_check_space_binds_the_space_once_and_its_codec_inverts_itself():
    s = SearchSpace.loads(SPACE, source="test.yaml")
    bound = check_space(s)
    assert isinstance(bound, BoundSpace) and bound.space is s and bound.candidates == CANDIDATES
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    rng = np.random.RandomState(0)
    for _ in range(30):
        trial = study.ask()
        plan = bound.plan(trial)
        params = bound.params(plan)
        assert bound.plan(optuna.trial.FixedTrial(params)) == plan
        key, completed = bound.key(trial.params, rng)
        assert key == plan.dumps() and bound.plan(optuna.trial.FixedTrial(completed)) == plan
        study.tell(trial, [0.0, 0.0])
    for (name, params), seed in zip(bound.seeds, s.seeds):
        assert name == seed.name and bound.plan(optuna.trial.FixedTrial(params)) == seed.plan


def test_rebind_keeps_the_binding_over_a_narrowed_space():
    s = SearchSpace.loads(SPACE, source="test.yaml")
    bound = check_space(s)
    narrowed = dataclasses.replace(s, cuts=dataclasses.replace(s.cuts, whole_step_graph=(False,)))
    again = bound.rebind(narrowed)
    assert again.space is narrowed and again.candidates == bound.candidates and again.seeds == bound.seeds
    assert again.can_detach is bound.can_detach and bound.space is s
    trial = optuna.create_study(directions=["maximize", "minimize"]).ask()
    assert not again.plan(trial).whole_step_graph
