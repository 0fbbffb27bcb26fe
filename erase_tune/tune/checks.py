"""Checking a search space against its workload's model, before any trial runs.

The workload is built on the CPU (its module is imported and its factory runs: space files
are trusted like scripts), the model is probed once, and every candidate is checked as the
plan checker would check it in a trial: it exists, it is called, a run of blocks is a chain,
and a cut does not produce the model's output. A candidate whose detachment would leave a
parameter untrained even with every candidate before it detached too (a cut upstream of
which nothing else trains the embeddings, say) is refused here, with one line naming it and
the parameters. For the others the probe gives the search a guard: detaching a candidate is
offered only when the cuts chosen before it cover its upstream (on a chain: the first
segment first), so no trial is ever spent on a plan that starves a parameter. Seeds are
checked as whole plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optuna
import torch

from erase_tune.errors import EraseTuneError, PlanError, shown
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.runtime.plan import targets_overlap
from erase_tune.runtime.probe import ProbeResult, probe
from erase_tune.tune.space import Guard, SearchSpace, plan_params
from erase_tune.workloads import get_workload

__all__ = ["CheckedSpace", "check_space"]


@dataclasses.dataclass(frozen=True)
class CheckedSpace:
    """What a driver needs from a checked space."""

    candidates: list[str]
    seeds: list[tuple[str, dict[str, Any]]]
    """(name, trial parameters) of each seed plan."""
    can_detach: Guard
    """Whether a candidate may be detached given the cuts chosen so far (no parameter starved)."""


def check_space(space: SearchSpace) -> CheckedSpace:
    """Check ``space`` against its model (see the module docstring), or raise one line."""
    try:
        workload = get_workload(space.workload, space.workload_args)
    except EraseTuneError as e:
        raise EraseTuneError(f"{space.source}: {e}") from None
    model = workload.build_model()
    candidates = list(space.candidates or workload.cut_candidates)
    for c in candidates:
        try:
            ErasePlan(cuts=(Cut(module=c),)).check_model(model)
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: cuts.candidates: {str(e).split(': ', 1)[-1]}") from None
    inputs, _ = workload.example(torch.device("cpu"))
    found = probe(model, tuple(inputs), candidates)
    can_detach = _guard(found)
    greedy: list[Cut] = []  # every earlier candidate that can be detached, detached
    for c in candidates:
        try:
            found.check_placement(c)
            if space.may_detach:
                found.check_cut(c)
                if any(targets_overlap(c, g.module) for g in greedy):
                    continue
                if not can_detach(greedy, c):
                    plan = ErasePlan(cuts=(*greedy, Cut(module=c)))
                    raise PlanError(f"{found.starved_message(plan, found.untrained(plan))}, even with every "
                                    "candidate before it detached too")
                greedy.append(Cut(module=c))
        except PlanError as e:
            raise EraseTuneError(f"{space.source}: cuts.candidates: {e}") from None
    seeds = []
    for i, (seed_name, plan) in enumerate(space.seeds):
        try:
            plan.check_model(model)
            found.check_plan(plan)
            params = plan_params(space, plan, candidates, can_detach)
            if space.plan_from_trial(optuna.trial.FixedTrial(params), candidates, can_detach) != plan:
                raise EraseTuneError("is not a plan this space can propose (its streams, λ or flags differ)")
            seeds.append((seed_name, params))
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: seeds[{i}] ({shown(seed_name)}): {e}") from None
    return CheckedSpace(candidates=candidates, seeds=seeds, can_detach=can_detach)


def _guard(found: ProbeResult) -> Guard:
    """Detaching a candidate is allowed when it starves no parameter the cuts before it did not."""
    cache: dict[frozenset[str], frozenset[str]] = {}

    def starved(cuts: Sequence[Cut]) -> frozenset[str]:
        key = frozenset(c.module for c in cuts)
        if key not in cache:
            cache[key] = frozenset(found.untrained(ErasePlan(cuts=tuple(Cut(module=m) for m in sorted(key)))))
        return cache[key]

    return lambda cuts, candidate: starved([*cuts, Cut(module=candidate)]) <= starved(cuts)
