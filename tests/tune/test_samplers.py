"""Every sampler a space may name drives the conditional plan space (real Optuna studies)."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from erase_tune.store.storage import open_storage
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import CONSTRAINTS, SAMPLERS, Attr, make_sampler, open_study, pareto_front
from tests.tune.test_space import CANDIDATES, SPACE


@pytest.mark.parametrize("name", SAMPLERS)
def test_sampler_proposes_valid_plans_and_respects_the_ne_budget(name, tmp_path):
    space = SearchSpace.loads(SPACE, source="test.yaml")
    bound = BoundSpace.unchecked(space, CANDIDATES)
    db = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = open_study(db, f"s-{name}", sampler=make_sampler(name, seed=0))
    assert study.metric_names == ["qps_gain", "ne_gap"]
    study_id = db.optuna.get_study_id_from_name(f"s-{name}")
    for i in range(12):
        trial = study.ask()
        plan = bound.plan(trial)
        gain, gap = 0.01 * len(plan.cuts), 0.02 * len(plan.cuts)  # more cuts: faster but worse NE
        trial.set_user_attr(Attr.PLAN, plan.to_dict())
        trial.set_user_attr("gain_vs_eager", gain)
        trial_id = db.optuna.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        db.optuna.set_trial_system_attr(trial_id, CONSTRAINTS, [gap - space.max_ne_gap])
        study.tell(trial, [gain, gap])
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 12
    front = pareto_front(study, space.max_ne_gap)
    assert front and all(p.ne_gap <= space.max_ne_gap for p in front)
    # The constraint the driver writes is the one the samplers (and Optuna's feasibility) read.
    assert all(list(t.constraints.values()) == [t.values[1] - space.max_ne_gap]
               for t in study.get_trials(states=(TrialState.COMPLETE,)))
    db.close()


def test_the_front_sampler_changes_one_parameter_of_a_measured_trial():
    """After the start-up trials every proposal is a measured trial with one parameter changed,
    until the feasible optimum is found (then its neighbourhood is spent and fresh random
    draws follow); the optimum is found within 20 trials."""
    import optuna

    from erase_tune.tune.search.samplers import FrontSampler

    def objective(params: dict) -> tuple[float, float]:
        x = [params[f"x{i}"] for i in range(5)]
        return float(sum(x)), float(x[0] + x[1]) / 10  # more is faster; x0, x1 cost "NE"

    for seed in range(3):
        study = optuna.create_study(directions=["maximize", "minimize"],
                                    sampler=FrontSampler(seed=seed, restart=0.0))
        for i in range(20):
            trial = study.ask()
            params = {f"x{k}": trial.suggest_categorical(f"x{k}", [0, 1, 2]) for k in range(5)}
            gain, gap = objective(params)
            trial.set_constraint("budget", gap - 0.25)
            done = study.get_trials(states=(TrialState.COMPLETE,))
            if i >= 2:
                assert any(sum(t.params[k] != params[k] for k in params) == 1 for t in done), (seed, i)
            study.tell(trial, [gain, gap])
            if gain >= 8 and gap <= 0.25:  # x2..x4 at 2 and x0+x1 <= 2: the feasible optimum
                break
        else:
            raise AssertionError(f"seed {seed}: no feasible optimum in 20 trials")


def test_the_front_sampler_combines_moves_it_has_seen_help():
    """Two changes measured separately, each faster at no NE cost, are proposed together next;
    a change measured to cost more NE than the budget allows is not applied elsewhere."""
    import optuna

    from erase_tune.tune.search.samplers import FrontSampler

    gains = {"a": 0.05, "b": 0.04, "c": 0.10}
    gaps = {"a": 0.0, "b": 0.0, "c": 0.03}  # "c" is fast but over the 1% budget

    def measure(trial: optuna.trial.Trial) -> list[float]:
        on = [k for k in "abcd" if trial.suggest_categorical(k, ["keep", "place"]) == "place"]
        gap = sum(gaps.get(k, 0.0) for k in on)
        trial.set_constraint("ne_gap", gap - 0.01)
        return [sum(gains.get(k, 0.0) for k in on), gap]

    study = optuna.create_study(directions=["maximize", "minimize"],
                                sampler=FrontSampler(seed=0, restart=0.0, max_ne_gap=0.01))
    base = {k: "keep" for k in "abcd"}
    for changed in ("", "a", "b", "c"):
        study.enqueue_trial({**base, **({changed: "place"} if changed else {})})
    for _ in range(4):
        trial = study.ask()
        study.tell(trial, measure(trial))
    trial = study.ask()
    measure(trial)
    assert {k: trial.params[k] for k in "abc"} == {"a": "place", "b": "place", "c": "keep"}, trial.params


def test_the_front_sampler_reads_the_budget_from_the_constraint():
    """Without ``max_ne_gap`` it takes the budget from the constraint the driver writes
    (``ne_gap - max_ne_gap``): the same proposals as when told."""
    import optuna

    from erase_tune.tune.search.samplers import FrontSampler

    def run(sampler: FrontSampler) -> list[dict]:
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        for _ in range(15):
            trial = study.ask()
            x = [trial.suggest_categorical(f"x{k}", [0, 1, 2]) for k in range(4)]
            trial.set_constraint("ne_gap", x[0] / 100 - 0.015)
            study.tell(trial, [float(sum(x)) - 2 * x[3] * x[2], x[0] / 100])
        return [t.params for t in study.trials]

    assert run(FrontSampler(seed=3)) == run(FrontSampler(seed=3, max_ne_gap=0.015))


def test_the_front_sampler_proposes_plans_not_seen_before():
    """A repeat is answered from the earlier measurement: it spends a proposal and learns nothing.
    On 3^3 plans (18 within the budget), 20 proposals of the front sampler hold about 17.5
    distinct plans (mean of 10 seeds; before it avoided repeats: 12.7), random search's 14.6."""
    import statistics

    import optuna

    from erase_tune.tune.search.samplers import FrontSampler

    def distinct(sampler: optuna.samplers.BaseSampler) -> int:
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        for _ in range(20):
            trial = study.ask()
            x = [trial.suggest_categorical(f"x{k}", [0, 1, 2]) for k in range(3)]
            trial.set_constraint("budget", x[0] / 10 - 0.15)
            study.tell(trial, [float(sum(x)), x[0] / 10])
        return len({tuple(sorted(t.params.items())) for t in study.trials})

    front = statistics.mean(distinct(FrontSampler(seed=s)) for s in range(10))
    random = statistics.mean(distinct(optuna.samplers.RandomSampler(seed=s)) for s in range(10))
    assert front >= 16 and front > random + 1, (front, random)


def test_the_front_sampler_tells_plans_apart_by_the_space_not_by_parameters():
    """Several parameter sets make one plan (streams are renumbered in a plan's canonical
    form): given the space's ``plan_key``, the front sampler proposes a new plan every time
    (on the GPU, without it, 20 measured trials of the CTR space took 71 proposals)."""
    from erase_tune.tune.search.samplers import FrontSampler

    space = SearchSpace.loads(SPACE, source="test.yaml")
    bound = BoundSpace.unchecked(space, CANDIDATES)

    def proposals(sampler: FrontSampler) -> list[str]:
        import optuna

        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        plans = []
        for _ in range(25):
            trial = study.ask()
            plan = bound.plan(trial)
            plans.append(plan.canonical().dumps())
            placed = {p.module for p in plan.placements}
            gain = 0.01 * len(plan.cuts) + 0.005 * len(placed) - 0.002 * plan.num_streams
            gap = 0.004 * len(plan.cuts)
            trial.set_constraint("ne_gap", gap - space.max_ne_gap)
            study.tell(trial, [gain, gap])
        return plans

    keyed = proposals(FrontSampler(seed=0, plan_key=bound.key, max_ne_gap=space.max_ne_gap))
    assert len(set(keyed)) == len(keyed), "a plan was proposed twice"
    unkeyed = proposals(FrontSampler(seed=0, max_ne_gap=space.max_ne_gap))
    assert len(set(unkeyed)) < len(unkeyed)  # the failure the key prevents


def test_plan_key_completes_the_parameters_a_plan_needs():
    """A parameter set missing what a change makes appear (a detached cut's stream and λ) is
    completed with draws inside the space; the completed set makes the keyed plan."""
    import numpy as np
    import optuna

    space = SearchSpace.loads(SPACE, source="test.yaml")
    bound = BoundSpace.unchecked(space, CANDIDATES)
    key = bound.key
    rng = np.random.RandomState(0)
    k, full = key({f"{CANDIDATES[0]}.mode": "detach"}, rng)
    assert full[f"{CANDIDATES[0]}.mode"] == "detach" and set(full) > {f"{CANDIDATES[0]}.mode"}
    plan = bound.plan(optuna.trial.FixedTrial(full))
    assert plan.canonical().dumps() == k and plan.cuts[0].module == CANDIDATES[0]
