"""Replayed sampler studies: real Optuna studies over a space, trials answered from a table."""

from __future__ import annotations

import json

import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.replay import ReplayTable, replay_study, space_plans
from erase_tune.tune.search.space import SearchSpace
from tests.tune.faulty import TINY_CTR

SPACE = f"""
workload: {{name: ctr, args: {json.dumps(TINY_CTR)}}}
cuts:
  candidates: [subarchs.0, subarchs.1, subarchs.2]
  modes: [keep, place, detach]
  max_streams: 2
  streams: round_robin
  dispatch: [blocking]
  aux_weight: 1.0
max_ne_gap: 0.02
device: cpu
seeds:
  - name: no-cuts
    plan: {{cuts: []}}
"""


def _table(tmp_path, plans) -> ReplayTable:
    """A synthetic table: detaching gains speed and costs NE, placing gains a little for free."""
    rows = [{"plan": p.dumps(), "qps_gain": 0.03 * len(p.cuts) + 0.01 * len(p.placements) - 0.005 * len(p.cuts) ** 2,
             "ne_gap": 0.008 * len(p.cuts)} for p in plans]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"provenance": {"device_name": "synthetic"}, "plans": rows}))
    return ReplayTable.load(path)


def test_every_plan_of_a_finite_space_and_a_replayed_study(tmp_path):
    space = SearchSpace.loads(SPACE, source="replay.yaml")
    checked = check_space(space)
    plans = space_plans(checked)
    assert len(plans) == 27 and len({p.dumps() for p in plans}) == 27  # keep/place/detach on 3 candidates
    table = _table(tmp_path, plans)
    for sampler in ("random", "tpe"):
        run = replay_study(checked, table, sampler=sampler, seed=0, trials=20)
        assert len(run.points) == 20 and run.proposals >= 20  # repeats are asked but not counted
        assert list(run.hypervolume) == sorted(run.hypervolume) and run.hypervolume[-1] > 0
        assert run.points[0] == (0.0, 0.0)  # the enqueued no-cuts seed comes first


def test_a_table_that_does_not_cover_the_space_is_refused(tmp_path):
    space = SearchSpace.loads(SPACE, source="replay.yaml")
    checked = check_space(space)
    table = _table(tmp_path, space_plans(checked)[:3])
    with pytest.raises(EraseTuneError, match="does not cover this search space"):
        replay_study(BoundSpace.unchecked(space, checked.candidates), table, sampler="random", seed=0, trials=20)
    infinite = SearchSpace.loads(SPACE.replace("streams: round_robin", "streams: searched"), source="x.yaml")
    with pytest.raises(EraseTuneError, match="not a finite space"):
        space_plans(BoundSpace.unchecked(infinite, checked.candidates))


def test_a_replayed_study_with_the_screen_measures_its_singles_then_their_unions_first(tmp_path):
    """With ``screen=True`` the replay enqueues the structural screen as start's driver does: after
    the seed, each single (3 placements and 3 cuts, read from the table: 0.01 and 0.025 each),
    then the unions of the gainers, before the sampler proposes."""
    space = SearchSpace.loads(SPACE, source="replay.yaml")
    checked = check_space(space)
    table = _table(tmp_path, space_plans(checked))
    run = replay_study(checked, table, sampler="front", seed=0, trials=12, screen=True)
    assert run.points[0] == (0.0, 0.0)  # the seed
    singles = sorted((round(g, 6), round(n, 6)) for g, n in run.points[1:7])
    assert singles == [(0.01, 0.0)] * 3 + [(0.025, 0.008)] * 3, run.points
    assert max(g for g, _ in run.points[7:]) > 0.025  # a union of two gainers beats every single
    plain = replay_study(checked, table, sampler="front", seed=0, trials=12)
    assert sorted((round(g, 6), round(n, 6)) for g, n in plain.points[1:7]) != singles  # without it, the sampler's own plans
