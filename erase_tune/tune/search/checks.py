"""Checking a search space against its workload's model, before any trial runs.

The workload is built on the CPU (its module is imported and its factory runs: space files
are trusted like scripts), the model is probed once, and every candidate is checked for
what its modes ask, as the plan checker would check it in a trial: it exists, it is called,
a run of blocks is a chain; if it may be graphed, it takes and returns tensors and is called
once; if it may be detached, it does not produce the model's output. A candidate that can
never be detached (it produces the output, or detaching it would leave a parameter untrained
both alone and with every candidate before it detached too: a cut upstream of which nothing
else trains the embeddings, say) may still be placed or graphed, but a space that lists it with
detach among its modes is refused, with one line naming it and why: give it its own modes
(``{module: top_l, modes: [keep, place, graph]}``). Only the workload's own candidates (a
space that lists none) are taken as they come: one that can never be detached is offered
its other modes. For the others the probe gives the search a guard: detaching a candidate is
offered only when it starves nothing the cuts chosen before it did not (on a chain: the first
segment first; of sibling branches over a shared input, all but one), so no trial is ever
spent on a plan that starves a parameter. Seeds are
checked as whole plans. What it returns is the space bound to its model
(:class:`~erase_tune.tune.search.codec.BoundSpace`): the codec every later step uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import optuna
import torch

from erase_tune.errors import EraseTuneError, PlanError, shown
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.runtime.plan import targets_overlap
from erase_tune.runtime.probing import ProbeResult, probe
from erase_tune.tune.search.codec import BoundSpace, DetachGuard, Guard
from erase_tune.tune.search.space import SearchSpace
from erase_tune.workloads import get_workload

__all__ = ["check_space"]


def check_space(space: SearchSpace) -> BoundSpace:
    """Check ``space`` against its model (see the module docstring) and bind it, or raise one line."""
    try:
        workload = get_workload(space.workload.name, space.workload.args)
    except EraseTuneError as e:
        raise EraseTuneError(f"{space.source}: {e}") from None
    model = workload.build_model()
    candidates = list(space.cuts.modules or workload.cut_candidates)
    for c in candidates:
        try:
            ErasePlan(cuts=(Cut(module=c),)).check_model(model)
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: cuts.candidates: {str(e).split(': ', 1)[-1]}") from None
    inputs, _ = workload.example(torch.device("cpu"))
    found = probe(model, tuple(inputs), candidates, output=workload.output, model_loss=workload.model_loss)
    bound = BoundSpace(space, candidates)  # each candidate's modes, resolved once
    base_guard = DetachGuard(found)
    never: set[str] = set()  # candidates no plan may detach: offered their other modes only
    greedy: list[Cut] = []  # every earlier candidate that can be detached, detached
    for c in candidates:
        modes = bound.modes[c]
        try:
            found.check_placement(c)
            if "graph" in modes:
                found.check_graphed(c)
            if "detach" not in modes:
                continue
            why = _never_detached(found, base_guard, greedy, c)
            if why is None:
                if not any(targets_overlap(c, g.module) for g in greedy) and base_guard(greedy, c):
                    greedy.append(Cut(module=c))
            elif space.cuts.candidates or not set(modes) - {"keep", "detach"}:
                # Listed by the user for detaching: say why it cannot be, rather than never do it.
                raise PlanError(f"{why}; leave detach out of its modes" if space.cuts.own_modes(c) is not None else why)
            else:
                never.add(c)  # one of the workload's own candidates, offered its other modes
        except PlanError as e:
            raise EraseTuneError(f"{space.source}: cuts.candidates: {e}") from None
    bound = dataclasses.replace(bound, can_detach=base_guard.excluding(never))
    seeds = []
    for i, seed in enumerate(space.seeds):
        try:
            seed.plan.check_model(model)
            found.check_plan(seed.plan)
            params = bound.params(seed.plan)
            if bound.plan(optuna.trial.FixedTrial(params)) != seed.plan:
                raise EraseTuneError("is not a plan this space can propose (its streams, λ or flags differ)")
            seeds.append((seed.name, params))
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: seeds[{i}] ({shown(seed.name)}): {e}") from None
    return dataclasses.replace(bound, seeds=seeds)


def _never_detached(found: ProbeResult, can_detach: Guard, greedy: Sequence[Cut], candidate: str) -> str | None:
    """Why no plan can detach ``candidate``, or None if one can: detaching it alone starves
    nothing (a sibling branch over a shared input: the other branches still train the input),
    or detaching it after every earlier candidate that can be detached (``greedy``) does (a
    later segment of a chain, whose upstream the earlier cuts train)."""
    try:
        found.check_cut(candidate)
    except PlanError as e:
        return str(e)
    if can_detach([], candidate) or any(targets_overlap(candidate, g.module) for g in greedy) \
            or can_detach(greedy, candidate):
        return None
    plan = ErasePlan(cuts=(*greedy, Cut(module=candidate)))  # what starves even with the others' help
    message = found.starved_message(plan, found.untrained(plan))
    return f"{message}, even with every candidate before it detached too" if greedy else message
