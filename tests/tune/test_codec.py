"""The bound space: a space file read into typed sections, bound once by check_space, whose
codec turns Optuna parameters into plans and back."""

from __future__ import annotations

import dataclasses

import numpy as np
import optuna
import pytest

from erase_tune.runtime import ErasePlan
from erase_tune.measure.trial import Budget
from erase_tune.tune.search import space_file
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import SearchSpace, SpaceError
from tests.tune.test_space import CANDIDATES, SPACE


def test_a_space_file_is_typed_and_nested():
    f = space_file.loads(SPACE.replace("subarchs.3]", "{module: subarchs.3, modes: [keep, place]}]"), source="t.yaml")
    assert f.source == "t.yaml" and f.text.startswith("\nworkload:")
    assert f.workload == space_file.WorkloadSpec(name="ctr", args={"batch": 64})
    assert [c.module for c in f.cuts.candidates] == CANDIDATES
    assert f.cuts.candidates[3] == space_file.Candidate("subarchs.3", ("keep", "place"))
    assert f.cuts.candidates[0].modes is None and f.cuts.aux_weight == space_file.AuxWeight(0.1, 2.0, True)
    assert f.sampler == space_file.SamplerSpec("random", 3)
    assert isinstance(f.budget.per_trial, Budget) and f.budget.timeout_s == 60 and f.trials == 8
    assert [s.name for s in f.seeds] == ["no-cuts", "all", "placed"] and isinstance(f.seeds[1].plan, ErasePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.trials = 9  # type: ignore[misc]
    s = SearchSpace.from_file(f)
    assert s == SearchSpace.loads(f.text, source="t.yaml")
    assert s.candidate_modes == {"subarchs.3": ("keep", "place")} and s.budget is f.budget.per_trial


def test_file_errors_are_one_space_error_line():
    with pytest.raises(SpaceError, match=r"^t.yaml: cuts.max_streams: -1 must be an integer in 0..64$"):
        space_file.loads(SPACE.replace("max_streams: 3", "max_streams: -1"), source="t.yaml")


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
    for (name, params), (seed_name, plan) in zip(bound.seeds, s.seeds):
        assert name == seed_name and bound.plan(optuna.trial.FixedTrial(params)) == plan


def test_rebind_keeps_the_binding_over_a_narrowed_space():
    s = SearchSpace.loads(SPACE, source="test.yaml")
    bound = check_space(s)
    narrowed = dataclasses.replace(s, whole_step_graph=(False,))
    again = bound.rebind(narrowed)
    assert again.space is narrowed and again.candidates == bound.candidates and again.seeds == bound.seeds
    assert again.can_detach is bound.can_detach and bound.space is s
    trial = optuna.create_study(directions=["maximize", "minimize"]).ask()
    assert not again.plan(trial).whole_step_graph
