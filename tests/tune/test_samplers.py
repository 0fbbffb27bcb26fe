"""Every sampler a space may name drives the conditional plan space (real Optuna studies)."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from erase_tune.tune.space import SAMPLERS, SearchSpace
from erase_tune.tune.study import (
    Attr,
    make_sampler,
    open_study,
    pareto_front,
    set_ne_constraint,
)
from tests.tune.test_space import CANDIDATES, SPACE


@pytest.mark.parametrize("name", SAMPLERS)
def test_sampler_proposes_valid_plans_and_respects_the_ne_budget(name, tmp_path):
    space = SearchSpace.loads(SPACE, source="test.yaml")
    study = open_study(f"sqlite:///{tmp_path / 's.db'}", f"s-{name}", sampler=make_sampler(name, seed=0))
    assert study.metric_names == ["qps_gain", "ne_gap"]
    for i in range(12):
        trial = study.ask()
        plan = space.plan_from_trial(trial, CANDIDATES)
        gain, gap = 0.01 * len(plan.cuts), 0.02 * len(plan.cuts)  # more cuts: faster but worse NE
        trial.set_user_attr(Attr.PLAN, plan.to_dict())
        trial.set_user_attr(Attr.METRICS, {"gain_p90": gain})
        set_ne_constraint(trial, gap, space.max_ne_gap)
        study.tell(trial, [gain, gap])
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 12
    front = pareto_front(study, space.max_ne_gap)
    assert front and all(p.ne_gap <= space.max_ne_gap for p in front)
