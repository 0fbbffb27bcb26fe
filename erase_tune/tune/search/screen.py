"""The structural screen: the plans a good engineer would try first, measured before the sampler.

A sampler combines several elements per plan from its first trial on (a cut here, two
placements there, a graph), so the plans that win by one structural change alone (graph
``top_l`` and ``bot_l``, change nothing else) may never be measured. The screen measures
them first, in two stages:

- **Singles**, cheapest and exact first: the whole-step CUDA graph alone (when the space
  offers it as a choice); each candidate graphed on the main stream; each candidate placed
  on a side stream; each candidate cut alone, at λ 1 (clamped into the space's range) on a
  side stream, with the space's first dispatch and a per-cut graph where the space offers
  one (it cuts host cost on host-bound models). Every other choice is the space's fixed one
  (its first, or the whole-step graph where the space only offers that).
- **Unions** of the singles that gained (gain > 0 within the NE budget), once every single
  has a result: per module its best element; all pairs on disjoint modules, best sum of
  single gains first; then all of them together (greedy by gain, skipping one that overlaps
  an earlier pick). Side-stream elements of a union each get their own side stream (cycling
  when there are fewer streams than elements), as each had one to itself when measured alone.

**Where it starts.** Singles change the space's unchanged plan, unless the space's seeds hold
a better start: once every seed has a result, the screen starts from the seed that gained most
(within the NE budget), as an engineer with a working plan tries single changes to that plan.
A single then puts its element into the seed (replacing the seed's element on an overlapping
module: ``place m`` becomes ``cut m``), it "gained" when it beats the seed's gain, and unions
join such changes into the seed. A seed the screen's fixed choices cannot make again (another
dispatch, λ or per-cut graph) is no start. Until the seeds have results the screen waits.

A plan the space cannot make (a mode the candidate does not have, a cut the detach guard
refuses, a union outside the space) costs no trial: each screen plan is kept only if
:meth:`BoundSpace.params` accepts it and :meth:`BoundSpace.plan` of those parameters makes
exactly it again, so the enqueued parameters make the screen's plan. Plans equal in their
canonical form (a graph inside a whole-step graph is a placement or nothing) are screened once.

This module is pure: it sees the study only as the :class:`PlanResult` list it is given
(:func:`results_of` makes it from Optuna's trials), and :meth:`Screen.next` says which plan to
enqueue next; the driver (erase_tune.tune.run.loop) enqueues it, so the screen's trials are
ordinary trials that count toward ``--trials``. Unions wait for every single's result; while
a single still runs, :meth:`Screen.next` returns None (:meth:`Screen.waiting` says which),
so a driver with free slots lets the sampler go on meanwhile.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from erase_tune.errors import PlanError
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.plan import targets_overlap
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import SpaceError
from erase_tune.tune.search.study import CONSTRAINTS, Attr

__all__ = ["SINGLE", "UNION", "SEED", "SEARCH", "PHASES", "MEASURED", "RUNNING", "FAILED", "PlanResult",
           "ScreenStep", "Screen", "results_of", "phase_of", "screen_line"]

SEED, SINGLE, UNION, SEARCH = "seed", "screen-single", "screen-union", "search"
PHASES = (SEED, SINGLE, UNION, SEARCH)
"""A trial's phase (user attr ``phase``): the space's seeds, the screen's two stages, the sampler."""
MEASURED, RUNNING, FAILED = "measured", "running", "failed"

_WHOLE = "whole-step graph"
"""The name of the whole-step-graph single; it is no module, so it overlaps none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanResult:
    """What the study holds for one plan (one trial's view of it)."""

    plan_key: str
    """The canonical plan as YAML (``Attr.PLAN_KEY``)."""
    state: str
    """``measured``, ``running`` or ``failed``."""
    qps_gain: float | None = None
    """Measured only."""
    ne_gap: float | None = None
    """Measured only."""
    feasible: bool | None = None
    """Measured only: the NE gap within the study's budget (beyond its noise floor)."""
    screen_name: str | None = None
    """The screen step the trial was enqueued for, if any (``Attr.SCREEN_NAME``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScreenStep:
    """One plan of the screen, ready to enqueue."""

    phase: str
    """:data:`SINGLE` or :data:`UNION`."""
    name: str
    """Short and unique within the screen: ``graph top_l``, ``place bot_l + cut tower``."""
    plan: ErasePlan
    """Canonical."""
    params: dict[str, Any]
    """The trial parameters under which the space makes :attr:`plan` (for ``study.enqueue_trial``)."""

    @property
    def key(self) -> str:
        """The plan's canonical YAML: how the study's trials are matched to it."""
        return self.plan.dumps()


Element = Cut | Placement | Graphed


@dataclasses.dataclass(frozen=True)
class _Base:
    """The plan the singles change: the space's unchanged plan (``seed`` None), or a seed."""

    seed: str | None
    key: str
    """The base's canonical plan (how a seed's trial is found)."""
    elements: tuple[Element, ...] = ()
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class _Single:
    """A single and the one element it adds (None: the whole-step graph)."""

    step: ScreenStep
    element: Element | None
    order: int
    """Its place in the screen (names of unions follow it)."""

    @property
    def module(self) -> str | None:
        return None if self.element is None else self.element.module


class Screen:
    """The structural screen of one bound space (see the module docstring)."""

    def __init__(self, bound: BoundSpace) -> None:
        self.bound = bound
        s = bound.space.cuts
        self._whole = False not in s.whole_step_graph  # the space offers only the whole-step graph
        self._fup = s.find_unused_parameters[0]
        self._rng = np.random.RandomState(0)  # key() needs one; a complete parameter set draws nothing
        self._unchanged = _Base(None, self._plan([], whole=self._whole).dumps(), whole=self._whole)
        self._seeds = [b for name, params in bound.seeds if (b := self._seed_base(name, params)) is not None]
        """The seeds the screen may start from (module docstring)."""
        self._singles_by: dict[str | None, list[_Single]] = {}
        self.singles: tuple[ScreenStep, ...] = tuple(x.step for x in self._singles_of(self._unchanged))
        """The singles of the space's unchanged plan, in screen order (a seed that gains may
        replace them: :meth:`next`); what ``check`` lists and estimates count."""
        self._made: dict[tuple[str | None, tuple[int, ...]], ScreenStep | None] = {}
        """Each union built so far, by its base and singles: the driver asks on every admission."""

    def _seed_base(self, name: str, params: dict[str, Any]) -> _Base | None:
        """The seed as a base, if it changes something and the screen's fixed choices make it again."""
        try:
            key, _ = self.bound.key(params, self._rng)
            plan = ErasePlan.loads(key)
        except (SpaceError, PlanError):
            return None
        elements = (*plan.cuts, *plan.placements, *plan.graphs)
        if key == self._unchanged.key or self._plan(elements, whole=plan.whole_step_graph).dumps() != key:
            return None
        return _Base(name, key, elements, plan.whole_step_graph)

    def _singles_of(self, base: _Base) -> list[_Single]:
        """The singles that change ``base`` (each kept once, if the space makes it)."""
        if base.seed in self._singles_by:
            return self._singles_by[base.seed]
        out: list[_Single] = []
        seen = {base.key}
        for name, element, whole in self._single_elements():
            plan = self._plan(self._into(base, [] if element is None else [element]), whole=whole or base.whole)
            params = self._accept(plan)
            if params is None or plan.dumps() in seen:
                continue
            seen.add(plan.dumps())
            shown = name if base.seed is None else f"{name} (in {base.seed})"
            out.append(_Single(ScreenStep(phase=SINGLE, name=shown, plan=plan, params=params), element, len(out)))
        self._singles_by[base.seed] = out
        return out

    @staticmethod
    def _into(base: _Base, elements: Sequence[Element]) -> list[Element]:
        """``elements`` put into ``base``: its elements on modules they overlap give way."""
        kept = [b for b in base.elements if not any(targets_overlap(b.module, e.module) for e in elements)]
        return [*kept, *elements]

    def base(self, results: Sequence[PlanResult]) -> tuple[_Base, float] | None:
        """Where the screen starts, and that plan's gain: the seed with the best gain within the
        NE budget when it gained, else the space's unchanged plan (gain 0); None while a seed
        still runs (a seed the study never asked does not count)."""
        state = _States(results)
        best: tuple[_Base, float] = (self._unchanged, 0.0)
        for seed in self._seeds:
            r = state.by_key.get(seed.key)
            if r is not None and r.state == RUNNING:
                return None
            if r is not None and r.state == MEASURED and r.feasible and r.qps_gain is not None and r.qps_gain > best[1]:
                best = (seed, r.qps_gain)
        return best

    # -- the driver's questions ------------------------------------------------------------------

    def next(self, results: Sequence[PlanResult]) -> ScreenStep | None:
        """The first screen plan the study has not measured, is not running and has not seen
        fail; None when the screen is done, or while a seed or (for the unions) a single still
        runs (:meth:`waiting` names it)."""
        where = self.base(results)
        if where is None:
            return None
        state, singles = _States(results), self._singles_of(where[0])
        for x in singles:
            if state.of(x.step) is None:
                return x.step
        if any(state.of(x.step) == RUNNING for x in singles):
            return None
        return next((u for u in self._unions(state, *where) if state.of(u) is None), None)

    def waiting(self, results: Sequence[PlanResult]) -> list[str]:
        """What the screen's next plan waits for: the seeds still running (before any single),
        or the singles still running while every other one has a result (before the unions);
        empty when nothing waits."""
        where = self.base(results)
        state = _States(results)
        if where is None:
            return [f"seed {b.seed}" for b in self._seeds if (r := state.by_key.get(b.key)) and r.state == RUNNING]
        singles = [x.step for x in self._singles_of(where[0])]
        if any(state.of(step) is None for step in singles):
            return []
        return [step.name for step in singles if state.of(step) == RUNNING]

    def unions(self, results: Sequence[PlanResult]) -> list[ScreenStep] | None:
        """The unions the singles' results call for, in screen order; None while a seed or a
        single has no result yet."""
        where = self.base(results)
        if where is None:
            return None
        state = _States(results)
        if any(state.of(x.step) in (None, RUNNING) for x in self._singles_of(where[0])):
            return None
        return self._unions(state, *where)

    def done(self, results: Sequence[PlanResult]) -> bool:
        """Whether every screen plan has a result (measured or failed)."""
        unions = self.unions(results)
        if unions is None:
            return False
        state = _States(results)
        return all(state.of(u) in (MEASURED, FAILED) for u in unions)

    def stand(self, results: Sequence[PlanResult]) -> str:
        """Where the screen stands, one line: ``screen: 6 of 8 singles measured, 1 running; ...``."""
        where = self.base(results)
        if where is None:
            return "screen: waits for the seeds' results (it may start from one)"
        state = _States(results)
        of = [state.of(x.step) for x in self._singles_of(where[0])]
        start = "" if where[0].seed is None else f" (changes to seed {where[0].seed}, {where[1]:+.2%})"
        parts = [f"{of.count(MEASURED)} of {len(of)} singles measured"]
        parts += [f"{of.count(k)} {k}" for k in (RUNNING, FAILED) if of.count(k)]
        unions = self.unions(results)
        if unions is None:
            tail = "unions wait for the singles"
        else:
            uof = [state.of(u) for u in unions]
            tail = f"{uof.count(MEASURED)} of {len(uof)} unions measured" + "".join(
                f", {uof.count(k)} {k}" for k in (RUNNING, FAILED) if uof.count(k))
            if all(x in (MEASURED, FAILED) for x in uof):
                tail += " (done)"
        return f"screen{start}: {', '.join(parts)}; {tail}"

    def every_single(self) -> list[tuple[str, ErasePlan, bool]]:
        """``(name, plan, screened)`` of every single structural change the space's modes name,
        in screen order, including those the screen leaves out (a cut the detach guard refuses
        alone, a plan the space cannot make): what ``erase-tune check`` tries on the model.
        ``screened``: the screen measures it (it is one of :attr:`singles`)."""
        screened = {step.name for step in self.singles}
        out = []
        for name, element, whole in self._single_elements(guarded=False):
            try:
                plan = self._plan([] if element is None else [element], whole=whole)
            except PlanError:
                continue
            out.append((name, plan, name in screened))
        return out

    # -- building plans ---------------------------------------------------------------------------

    def _single_elements(self, guarded: bool = True) -> Iterable[tuple[str, Element | None, bool]]:
        """(name, element, whole-step graph) of each single, in screen order, before any check
        (but the detach guard's, unless ``guarded`` is False)."""
        s, b = self.bound.space.cuts, self.bound
        if set(s.whole_step_graph) == {False, True}:
            yield _WHOLE, None, True
        for c in b.candidates:
            if "graph" in b.modes[c]:
                yield f"graph {c}", Graphed(module=c, stream=0), self._whole
        for c in b.candidates:
            if "place" in b.modes[c] and s.max_streams:
                yield f"place {c}", Placement(module=c, stream=self._stream(c, 0)), self._whole
        low, high = s.aux_weight.low, s.aux_weight.high
        for c in b.candidates:
            if "detach" in b.modes[c] and (not guarded or b.can_detach is None or b.can_detach([], c)):
                stream = self._stream(c, 0) if s.max_streams else 0
                yield f"cut {c}", Cut(module=c, stream=stream, aux_weight=min(max(1.0, low), high)), self._whole

    def _stream(self, candidate: str, k: int) -> int:
        """The side stream of a plan's ``k``-th side-stream element: the candidate's own with
        ``streams: round_robin`` (the space fixes it), else the next one, cycling."""
        s = self.bound.space.cuts
        if s.streams == "round_robin":
            return 1 + self.bound.candidates.index(candidate) % s.max_streams
        return 1 + k % s.max_streams

    def _plan(self, elements: Sequence[Element], *, whole: bool) -> ErasePlan:
        """The canonical plan of ``elements`` with the space's fixed choices; side-stream
        elements (in candidate order) each get their own side stream."""
        s, order = self.bound.space.cuts, self.bound.candidates
        dispatch = s.dispatch[0]
        cut_graph = True in s.graph and dispatch != "deferred"  # a per-cut graph is never deferred
        cuts, placed, graphed, k = [], [], [], 0
        for e in sorted(elements, key=lambda e: order.index(e.module)):
            stream = e.stream
            if stream:
                stream, k = self._stream(e.module, k), k + 1
            if isinstance(e, Cut):
                cuts.append(dataclasses.replace(e, stream=stream, graph=cut_graph))
            elif isinstance(e, Placement):
                placed.append(dataclasses.replace(e, stream=stream))
            else:
                graphed.append(dataclasses.replace(e, stream=stream))
        return ErasePlan(cuts=tuple(cuts), placements=tuple(placed), graphs=tuple(graphed),
                         num_streams=s.max_streams, dispatch=dispatch if cuts else "blocking",
                         whole_step_graph=whole, find_unused_parameters=self._fup).canonical()

    def _accept(self, plan: ErasePlan) -> dict[str, Any] | None:
        """The parameters that make ``plan``, if the space makes exactly it from them; else None."""
        try:
            params = self.bound.params(plan)
        except (SpaceError, PlanError):
            return None
        key, asked = self.bound.key(params, self._rng)
        return params if key == plan.dumps() and asked == params else None

    def _unions(self, state: _States, base: _Base, base_gain: float) -> list[ScreenStep]:
        """Pairs of gainers, best sum of gains first, then all of them (module docstring)."""
        singles = self._singles_of(base)
        gain: dict[int, float] = {}
        best: dict[str | None, _Single] = {}  # per module its best-gain element
        for x in singles:
            r = state.result(x.step)
            if r is None or r.state != MEASURED or not r.feasible or r.qps_gain is None or r.qps_gain <= base_gain:
                continue
            gain[x.order] = r.qps_gain - base_gain
            if x.module not in best or r.qps_gain - base_gain > gain[best[x.module].order]:
                best[x.module] = x
        gainers = sorted(best.values(), key=lambda x: (-gain[x.order], x.order))
        out: list[ScreenStep] = []
        seen = {x.step.key for x in singles} | {base.key}
        pairs = [(a, b) for a, b in itertools.combinations(gainers, 2) if not _overlap(a, b)]
        pairs.sort(key=lambda p: (-(gain[p[0].order] + gain[p[1].order]), *sorted((p[0].order, p[1].order))))
        for pair in pairs:
            if (step := self._union(base, pair)) is not None and step.key not in seen:
                seen.add(step.key)
                out.append(step)
        picks: list[_Single] = []
        for x in gainers:
            if any(_overlap(x, p) for p in picks):
                continue
            if len(picks) < 1 or self._union(base, [*picks, x]) is not None:  # the space must make the union
                picks.append(x)
        if len(picks) > 2 and (step := self._union(base, picks)) is not None and step.key not in seen:
            out.append(step)
        return out

    def _union(self, base: _Base, parts: Sequence[_Single]) -> ScreenStep | None:
        """The union of ``parts`` (put into ``base``) as a screen step, or None when the space cannot make it."""
        parts = sorted(parts, key=lambda x: x.order)
        key = (base.seed, tuple(x.order for x in parts))
        if key not in self._made:
            self._made[key] = self._make_union(base, parts)
        return self._made[key]

    def _make_union(self, base: _Base, parts: Sequence[_Single]) -> ScreenStep | None:
        whole = self._whole or base.whole or any(x.element is None for x in parts)
        try:
            plan = self._plan(self._into(base, [x.element for x in parts if x.element is not None]), whole=whole)
        except PlanError:
            return None
        params = self._accept(plan)
        if params is None:
            return None
        names = " + ".join(x.step.name.removesuffix(f" (in {base.seed})") for x in parts)
        return ScreenStep(phase=UNION, name=names if base.seed is None else f"{names} (in {base.seed})",
                          plan=plan, params=params)


def _overlap(a: _Single, b: _Single) -> bool:
    return a.module is not None and b.module is not None and targets_overlap(a.module, b.module)


class _States:
    """The study's results by plan and by screen name: measured, else running, else failed."""

    _RANK = {MEASURED: 0, RUNNING: 1, FAILED: 2}

    def __init__(self, results: Sequence[PlanResult]) -> None:
        self.by_key: dict[str, PlanResult] = {}
        self.by_name: dict[str, PlanResult] = {}
        for r in results:
            if r.state not in self._RANK:
                continue
            for index, k in ((self.by_key, r.plan_key), (self.by_name, r.screen_name)):
                if k is not None and (k not in index or self._RANK[r.state] < self._RANK[index[k].state]):
                    index[k] = r

    def result(self, step: ScreenStep) -> PlanResult | None:
        return self.by_key.get(step.key)

    def of(self, step: ScreenStep) -> str | None:
        """The step's state: its plan's, else that of a trial enqueued for it (whose
        parameters made another plan: tried, so not enqueued again), else None."""
        r = self.by_key.get(step.key) or self.by_name.get(step.name)
        return None if r is None else r.state


# -- reading the study ------------------------------------------------------------------------------


def results_of(trials: Iterable[Any]) -> list[PlanResult]:
    """What ``trials`` (Optuna ``FrozenTrial`` s, read only through their plain fields) hold per
    plan: a trial with a plan that is no repeat, measured, running or failed."""
    out = []
    for t in trials:
        attrs = t.user_attrs
        key = attrs.get(Attr.PLAN_KEY)
        if not isinstance(key, str) or Attr.DUPLICATE_OF in attrs:
            continue  # not yet turned into a plan, or a repeat (its earlier trial holds the result)
        name = attrs.get(Attr.SCREEN_NAME) if isinstance(attrs.get(Attr.SCREEN_NAME), str) else None
        state = t.state.name
        if state == "COMPLETE" and t.values is not None and len(t.values) == 2:
            feasible = attrs.get(Attr.FEASIBLE)
            if not isinstance(feasible, bool):  # a trial recorded without it: its stored constraint says
                constraints = t.system_attrs.get(CONSTRAINTS) or [0.0]
                feasible = all(c <= 0 for c in constraints)
            out.append(PlanResult(plan_key=key, state=MEASURED, qps_gain=float(t.values[0]),
                                  ne_gap=float(t.values[1]), feasible=feasible, screen_name=name))
        elif state in ("RUNNING", "FAIL"):
            out.append(PlanResult(plan_key=key, state=RUNNING if state == "RUNNING" else FAILED, screen_name=name))
    return out


def phase_of(user_attrs: Any) -> str:
    """A trial's phase (:data:`PHASES`) from its user attributes; a trial stored before phases
    were recorded is a seed if it has a seed name, else the sampler's."""
    phase = user_attrs.get(Attr.PHASE)
    if phase in PHASES:
        return phase
    return SEED if user_attrs.get(Attr.SEED_NAME) is not None else SEARCH


def screen_line(trials: Iterable[tuple[str, str]]) -> str | None:
    """Where the screen stands, from each trial's ``(phase, state)`` (state: ``measured``,
    ``running``, ``failed``, or anything else, not counted): ``screen: 6 singles measured, 1
    running; 2 unions measured``; None when no trial was the screen's."""
    counts: dict[tuple[str, str], int] = {}
    for phase, state in trials:
        counts[phase, state] = counts.get((phase, state), 0) + 1
    if not any(phase in (SINGLE, UNION) for phase, _ in counts):
        return None
    parts = []
    for phase, what in ((SINGLE, "singles"), (UNION, "unions")):
        n = counts.get((phase, MEASURED), 0)
        more = "".join(f", {counts[phase, k]} {k}" for k in (RUNNING, FAILED) if counts.get((phase, k)))
        parts.append(f"{n} {what} measured{more}")
    return "screen: " + "; ".join(parts)
