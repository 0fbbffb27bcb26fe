"""The front and the export rule, on an in-memory study: NE gaps within the noise floor count as
equal (a slower plan never stays on the front for a noise-level NE edge), and the plan chosen is
the one with the best confirmed lower bound, by the same rule ``start`` and ``export`` apply."""

from __future__ import annotations

import datetime as dt

import optuna

from erase_tune.runtime import Cut, ErasePlan, Graphed
from erase_tune.store import Confirmation
from erase_tune.tune.run.confirm import choose
from erase_tune.tune.search.study import DIRECTIONS, Attr, pareto_front

GRAPH = ErasePlan(graphs=(Graphed(module="top_l", stream=0),))
CUT = ErasePlan(cuts=(Cut(module="bot_l", stream=1),), num_streams=1)


def _study(band: float | None, trials: list[tuple[ErasePlan, float, float]], exact: set[int] = frozenset()
           ) -> optuna.Study:
    study = optuna.create_study(directions=list(DIRECTIONS))
    if band is not None:
        study.set_user_attr(Attr.NOISE_BAND, band)
    for i, (plan, gain, gap) in enumerate(trials):
        study.add_trial(optuna.trial.create_trial(values=[gain, gap], user_attrs={Attr.PLAN: plan.to_dict(),
                                                                                  Attr.EXACT: i in exact}))
    return study


def test_ne_gaps_within_the_noise_floor_count_as_equal():
    trials = [(GRAPH, 0.10, 0.0), (CUT, 0.08, -0.004)]
    assert [p.number for p in pareto_front(_study(None, trials))] == [0, 1]  # no floor: a real trade-off
    assert [p.number for p in pareto_front(_study(0.005, trials))] == [0]  # -0.4% is noise within ±0.5%
    # beyond the floor the NE edge is real, and the slower plan stays on the front
    assert [p.number for p in pareto_front(_study(0.002, trials))] == [0, 1]


def _confirmation(number: int, gain: float, lo: float, hi: float) -> Confirmation:
    return Confirmation(job_id=1, trial_number=number, plan_yaml="", gain_over="eager", windows=20, gain=gain,
                        gain_lo=lo, gain_hi=hi, samples={}, provenance={}, created_at=dt.datetime.now())


def test_the_best_lower_bound_is_chosen_not_the_best_reading():
    study = _study(None, [(GRAPH, 0.16, 0.0), (CUT, 0.09, -0.01)])
    front = pareto_front(study)
    lucky = {0: _confirmation(0, 0.12, 0.01, 0.23), 1: _confirmation(1, 0.09, 0.07, 0.11)}
    choice = choose(front, lucky, {}, max_ne_gap=0.01, band=0.0)
    assert choice.refusal is None and choice.point.number == 1  # +9% [7%, 11%] beats +12% [1%, 23%]
    unproven = {0: _confirmation(0, 0.05, -0.02, 0.12), 1: _confirmation(1, 0.01, -0.01, 0.03)}
    refused = choose(front, unproven, {}, max_ne_gap=0.01, band=0.0)
    assert refused.refusal is not None and "shows a gain" in refused.refusal and refused.point.number == 1


def test_a_plan_with_cuts_whose_ne_was_not_confirmed_is_not_chosen_when_quality_is_required():
    study = _study(None, [(CUT, 0.17, 0.006), (GRAPH, 0.14, 0.0)], exact={1})
    front = pareto_front(study)
    confirmed = {0: _confirmation(0, 0.17, 0.15, 0.19), 1: _confirmation(1, 0.16, 0.14, 0.18)}
    assert choose(front, confirmed, {}, max_ne_gap=0.01, band=0.0).point.number == 0
    # the job had no time to train the cut longer: the exact plan, which needs no NE confirmation, is chosen
    choice = choose(front, confirmed, {}, max_ne_gap=0.01, band=0.0, quality_required=True)
    assert choice.refusal is None and choice.point.number == 1
    only_cut = choose(front[:1], confirmed, {}, max_ne_gap=0.01, band=0.0, quality_required=True)
    assert only_cut.refusal is not None and "--quality-scale" in only_cut.refusal
    # a plan with no cuts whose gradient check failed is not exact either: it needs its NE confirmed too
    unverified = pareto_front(_study(None, [(GRAPH, 0.17, 0.0)]))
    assert choose(unverified, {0: confirmed[0]}, {}, max_ne_gap=0.01, band=0.0, quality_required=True).refusal


def test_the_best_exact_plan_is_among_the_finalists():
    from erase_tune.tune.search.study import finalists

    cut2 = ErasePlan(cuts=(Cut(module="top_l", stream=1),), num_streams=1)
    study = _study(None, [(CUT, 0.80, 0.011), (cut2, 0.60, 0.0003), (GRAPH, 0.50, 0.0), (CUT, 0.55, 0.009),
                          (GRAPH, 0.44, 0.0)], exact={4})
    assert [p.number for p in finalists(study, 0.02, 3)] == [0, 1, 4]
