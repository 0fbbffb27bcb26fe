"""Sampler efficiency by replay: real Optuna studies whose trials are answered from a table of
plans measured on a GPU, looked up by canonical plan.

Comparing samplers needs many studies (samplers × seeds × dozens of trials); running each
trial on an H200 would cost hours. Instead every plan of a finite search space is measured
once on the GPU (``scripts/measure_replay_table.py``) and the studies run on a CPU, each
proposal answered with its plan's measured (QPS gain, NE gap). The studies are real (the
bound space's own conditional codec, the NE budget as Optuna's constraint, repeats of a
measured plan answered without counting, as the driver does); only the measurement is
replayed, and every result says so (``ReplayTable.provenance``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import ErasePlan
from erase_tune.tune.search.hypervolume import hypervolume_history
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.screen import Screen, results_of
from erase_tune.tune.search.study import DIRECTIONS, Attr, make_sampler

__all__ = ["ReplayTable", "replay_study", "ReplayRun", "space_plans"]


def space_plans(bound: BoundSpace) -> list[ErasePlan]:
    """Every distinct canonical plan of a finite space (one choice of stream per candidate:
    ``streams: round_robin``; a fixed λ; one dispatch and one whole-step-graph choice)."""
    cuts, candidates = bound.space.cuts, bound.candidates
    if cuts.streams != "round_robin" or cuts.aux_weight.low != cuts.aux_weight.high or len(cuts.dispatch) > 1 \
            or len(cuts.whole_step_graph) > 1 or len(cuts.graph) > 1:
        raise EraseTuneError(f"{bound.space.source}: not a finite space (needs streams: round_robin, a fixed "
                             "aux_weight, one dispatch, one graph and one whole_step_graph choice)")
    out: dict[str, ErasePlan] = {}
    for modes in itertools.product(*(bound.modes[c] for c in candidates)):
        params: dict[str, Any] = {"whole_step_graph": cuts.whole_step_graph[0], "dispatch": cuts.dispatch[0]}
        for c, m in zip(candidates, modes):
            params[f"{c}.mode"] = params[f"{c}.mode_upstream"] = m
        try:
            plan = bound.plan(optuna.trial.FixedTrial(params))
        except ValueError:  # a choice the space does not offer there (detach guarded upstream)
            continue
        out.setdefault(plan.canonical().dumps(), plan.canonical())
    return list(out.values())


@dataclasses.dataclass(frozen=True)
class ReplayTable:
    """Measured ``(qps_gain, ne_gap)`` of each plan of a space, by canonical plan (YAML)."""

    points: Mapping[str, tuple[float, float]]
    provenance: Mapping[str, Any]
    """Where, when and how the table was measured (device, versions, workload, budget)."""

    @classmethod
    def load(cls, path: str | Path) -> ReplayTable:
        try:
            data = json.loads(Path(path).read_text())
            points = {p["plan"]: (float(p["qps_gain"]), float(p["ne_gap"])) for p in data["plans"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EraseTuneError(f"{path}: not a replay table ({e})") from None
        return cls(points=points, provenance=dict(data.get("provenance") or {}))

    def lookup(self, plan: ErasePlan) -> tuple[float, float]:
        key = plan.canonical().dumps()
        if key not in self.points:
            raise EraseTuneError(f"the replay table has no measurement of the plan {plan.describe()!r}: it does not "
                                 "cover this search space")
        return self.points[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayRun:
    sampler: str
    seed: int
    points: tuple[tuple[float, float], ...]
    """(QPS gain, NE gap) of each measured (non-repeated) plan, in the order proposed."""
    hypervolume: tuple[float, ...]
    """Hypervolume within the NE budget after each measured plan."""
    proposals: int
    """Trials asked in all, repeats included."""


def replay_study(bound: BoundSpace, table: ReplayTable, *, sampler: str, seed: int, trials: int,
                 max_proposals: int | None = None, screen: bool = False) -> ReplayRun:
    """Run one study of ``trials`` measured plans against ``table`` (see the module docstring).
    The space's seed plans are enqueued first, as ``erase-tune start`` does; with ``screen``,
    the structural screen's plans are enqueued next, one at a time as the driver does
    (erase_tune.tune.search.screen), and the sampler goes on from there."""
    optuna.logging.set_verbosity(logging.WARNING)
    space = bound.space
    chosen = make_sampler(sampler, seed, max_ne_gap=space.max_ne_gap, plan_key=bound.key)
    study = optuna.create_study(directions=list(DIRECTIONS), sampler=chosen)
    for seed_plan in space.seeds:
        study.enqueue_trial(bound.params(seed_plan.plan))
    seen: dict[str, tuple[float, float]] = {}
    points: list[tuple[float, float]] = []
    proposals = 0
    limit = max_proposals or 50 * trials
    screening = Screen(bound) if screen else None
    while len(points) < trials and proposals < limit:
        if screening is not None:
            known = study.get_trials(deepcopy=False)
            step = None if any(t.state == optuna.trial.TrialState.WAITING for t in known) else \
                screening.next(results_of(known))
            if step is not None:
                study.enqueue_trial(step.params, user_attrs={Attr.PHASE: step.phase, Attr.SCREEN_NAME: step.name})
        trial = study.ask()
        proposals += 1
        plan = bound.plan(trial)
        key = plan.canonical().dumps()
        gain, gap = seen.get(key) or table.lookup(plan)
        if not (math.isfinite(gain) and math.isfinite(gap)):
            raise EraseTuneError(f"the replay table holds a non-finite measurement for {plan.describe()!r}")
        trial.set_user_attr(Attr.PLAN_KEY, plan.dumps())  # what the screen reads back, as the driver writes it
        trial.set_user_attr(Attr.FEASIBLE, gap <= space.max_ne_gap)
        trial.set_constraint("ne_gap", gap - space.max_ne_gap)
        study.tell(trial, [gain, gap])
        if key not in seen:
            seen[key] = (gain, gap)
            points.append((gain, gap))
    return ReplayRun(sampler=sampler, seed=seed, points=tuple(points),
                     hypervolume=tuple(hypervolume_history(points, space.max_ne_gap)), proposals=proposals)
