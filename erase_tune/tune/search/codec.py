"""The codec between Optuna parameters and plans, for one space bound to its model.

A :class:`BoundSpace` is the space, the candidates it searches (its own, or the workload's)
with each one's modes, its seed plans as trial parameters, and the guard that says when a
candidate may be detached (:class:`DetachGuard`, the model's probe asked once per set of
cuts). :func:`erase_tune.tune.search.checks.check_space` makes it once, before any trial
runs; the driver, the sampler and the replay use that one object, and it needs nothing from
the modules before it once made. Both directions of the
codec sit here side by side and are kept inverse to each other: :meth:`BoundSpace.plan`
(define-by-run: ask an Optuna trial for one plan) and :meth:`BoundSpace.params` (the
parameters under which :meth:`~BoundSpace.plan` yields a given plan, for
``study.enqueue_trial``); :meth:`BoundSpace.key` (parameters -> canonical plan) is how the
default sampler tells plans apart.

Each candidate gets one choice among keep / place on a side stream / detach on a stream /
graph (captured as a CUDA graph inside the eager step, not detached, on the main stream or a
side stream); which of them a candidate is offered is the space's ``modes``, or the
candidate's own. The space is conditional, so no trial is spent on a meaningless
combination: a stream is only asked for a placed, detached or graphed candidate, λ and the
graph flag only for detached ones, dispatch and per-cut graph flags only without a
whole-step graph (launch order is fixed at capture there), and a candidate overlapping one
already used in the plan is not asked. Stream ids are interchangeable, so every plan is
canonicalised (``ErasePlan.canonical``) and the driver answers a repeat of an already
measured plan from the study instead of re-running it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.plan import targets_overlap
from erase_tune.tune.search.space import CutsSpec, SearchSpace, SpaceError

if TYPE_CHECKING:
    from erase_tune.runtime.probing import ProbeResult

__all__ = ["BoundSpace", "DetachGuard", "Guard"]

Guard = Callable[[Sequence[Cut], str], bool]
"""``(cuts chosen so far, candidate) -> whether the candidate may be detached now``."""


class DetachGuard:
    """A :data:`Guard` from the model's probe: detaching a candidate is allowed when it starves
    no parameter the cuts before it did not, and it is not among ``never`` (candidates no plan
    may detach). What a set of cuts starves is asked of the probe once."""

    def __init__(self, found: ProbeResult, never: Iterable[str] = ()) -> None:
        self.found, self.never = found, frozenset(never)
        self._starved: dict[frozenset[str], frozenset[str]] = {}

    def excluding(self, never: Iterable[str]) -> DetachGuard:
        """The same guard (and what it has learnt) that also refuses ``never``."""
        guard = DetachGuard(self.found, self.never | frozenset(never))
        guard._starved = self._starved
        return guard

    def __call__(self, cuts: Sequence[Cut], candidate: str) -> bool:
        return candidate not in self.never and self.starved([*cuts, Cut(module=candidate)]) <= self.starved(cuts)

    def starved(self, cuts: Sequence[Cut]) -> frozenset[str]:
        """The parameters a plan of ``cuts`` leaves without a gradient."""
        key = frozenset(c.module for c in cuts)
        if key not in self._starved:
            plan = ErasePlan(cuts=tuple(Cut(module=m) for m in sorted(key)))
            self._starved[key] = frozenset(self.found.untrained(plan))
        return self._starved[key]


@dataclasses.dataclass(frozen=True, eq=False)
class BoundSpace:
    """A space bound to its model's candidates (see the module docstring)."""

    space: SearchSpace
    candidates: list[str]
    """In the order the plan asks them: the space's own, else the workload's."""
    seeds: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    """(name, trial parameters) of each seed plan of the space."""
    can_detach: Guard | None = None
    """Whether a candidate may be detached given the cuts chosen so far (no parameter
    starved); None: always (a space bound without its model, in tests)."""
    modes: Mapping[str, tuple[str, ...]] = dataclasses.field(init=False, repr=False)
    """Each candidate's choices among the modes (its own, else the space's), resolved at binding."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", {c: self.space.modes_of(c) for c in self.candidates})

    @classmethod
    def unchecked(cls, space: SearchSpace, candidates: Sequence[str], can_detach: Guard | None = None) -> BoundSpace:
        """``space`` bound to ``candidates`` without looking at the model (no seeds): for tests
        and tools that already know the candidates. The service binds through ``check_space``."""
        return cls(space, list(candidates), [], can_detach)

    def rebind(self, space: SearchSpace) -> BoundSpace:
        """The same candidates, seeds and guard over ``space``: the job narrows a checked space
        (``whole_step_graph`` limited to false when the model's step cannot be captured)."""
        return dataclasses.replace(self, space=space)

    # -- parameters -> plan ------------------------------------------------------------------

    def plan(self, trial: Any) -> ErasePlan:
        """Define-by-run: ask ``trial`` (an Optuna trial) for one plan of this space.

        Where detaching a candidate now would leave a parameter untrained (:attr:`can_detach`),
        it is only offered its other modes (under another parameter name, so every name keeps
        one set of choices)."""
        s, candidates = self.space.cuts, self.candidates
        whole = _choose(trial, "whole_step_graph", s.whole_step_graph)
        cuts: list[Cut] = []
        placed: list[Placement] = []
        graphed: list[Graphed] = []
        used: list[str] = []
        for c in candidates:
            if any(targets_overlap(c, u) for u in used):
                continue  # a module is in one plan element at most: this candidate is not asked
            name, modes = self._modes(c, cuts)
            mode = _choose(trial, name, modes)
            if mode != "keep":
                used.append(c)
            fixed = 1 + candidates.index(c) % s.max_streams if s.max_streams else 0
            rr = s.streams == "round_robin"
            if mode == "place" and s.max_streams:
                stream = fixed if rr else trial.suggest_int(f"{c}.place_stream", 1, s.max_streams)
                placed.append(Placement(module=c, stream=stream))
            elif mode == "detach":
                stream = fixed if rr or not s.max_streams else trial.suggest_int(f"{c}.stream", 0, s.max_streams)
                aux = s.aux_weight
                weight = trial.suggest_float(f"{c}.aux_weight", aux.low, aux.high, log=aux.log) \
                    if aux.low < aux.high else aux.low
                cuts.append(Cut(module=c, stream=stream, aux_weight=weight))
            elif mode == "graph":
                # Under a whole-step graph the piece is in the step's graph already: canonical()
                # makes it a placement (side stream) or nothing (main stream), so the study
                # answers it from the equal plan it may have measured.
                stream = fixed if rr or not s.max_streams else trial.suggest_int(f"{c}.graph_stream", 0,
                                                                                 s.max_streams)
                graphed.append(Graphed(module=c, stream=stream))
        dispatch = "blocking"
        if cuts and not whole:
            dispatch = _choose(trial, "dispatch", s.dispatch)
            if dispatch != "deferred":  # a per-cut graph holds its backward: never deferred
                cuts = [dataclasses.replace(c, graph=_choose(trial, f"{c.module}.graph", s.graph)) for c in cuts]
        fup = _choose(trial, "find_unused_parameters", s.find_unused_parameters)
        plan = ErasePlan(cuts=tuple(cuts), placements=tuple(placed), graphs=tuple(graphed),
                         num_streams=s.max_streams, dispatch=dispatch, whole_step_graph=whole,
                         find_unused_parameters=fup)
        return plan.canonical()

    # -- plan -> parameters (the inverse of plan) --------------------------------------------

    def params(self, plan: ErasePlan) -> dict[str, Any]:
        """The trial parameters under which :meth:`plan` yields ``plan`` (for
        ``study.enqueue_trial``); raises SpaceError if the plan lies outside the space."""
        s, candidates = self.space.cuts, self.candidates
        cut_of = {c.module: c for c in plan.cuts}
        place_of = {p.module: p for p in plan.placements}
        graph_of = {g.module: g for g in plan.graphs}
        unknown = sorted((set(cut_of) | set(place_of) | set(graph_of)) - set(candidates))
        if unknown:
            raise SpaceError(f"{unknown[0]!r} is not among the space's candidates ({', '.join(candidates)})")
        params = _Params(s)
        fix, stream = params.fix, params.stream
        fix("whole_step_graph", plan.whole_step_graph, s.whole_step_graph)
        used: list[str] = []
        for c in candidates:
            if any(targets_overlap(c, u) for u in used):
                continue  # not asked by plan() either
            cut, placed, graphed = cut_of.get(c), place_of.get(c), graph_of.get(c)
            mode = "detach" if cut else "place" if placed else "graph" if graphed else "keep"
            name, modes = self._modes(c, [x for x in plan.cuts if candidates.index(x.module) < candidates.index(c)])
            if mode == "detach" and "detach" not in modes:
                raise SpaceError(f"cut {c!r} would leave parameters untrained unless the candidates before it are cut")
            if placed is not None and plan.whole_step_graph and "place" not in modes and "graph" in modes:
                # Inside a whole-step graph a graphed piece on a side stream is canonically a placement.
                mode, graphed, placed = "graph", Graphed(module=c, stream=placed.stream), None
            fix(name, mode, modes)
            if mode != "keep":
                used.append(c)
            if placed is not None:
                stream(f"{c}.place_stream", placed.stream, 1)
            if graphed is not None and s.max_streams:
                stream(f"{c}.graph_stream", graphed.stream, 0)
            if cut is not None:
                params.cut(cut)
        if plan.cuts and not plan.whole_step_graph:
            fix("dispatch", plan.dispatch, s.dispatch)
            if plan.dispatch != "deferred":
                for cut in plan.cuts:
                    fix(f"{cut.module}.graph", cut.graph, s.graph)
        fix("find_unused_parameters", plan.find_unused_parameters, s.find_unused_parameters)
        return params.values

    # -- parameters -> canonical plan, for the sampler ---------------------------------------

    def key(self, params: dict[str, Any], rng: Any) -> tuple[str, dict[str, Any]]:
        """``(canonical plan as YAML, the parameters that make it)``: the parameters a plan
        needs and ``params`` lacks (the space is conditional) are drawn at random (``rng``: a
        ``numpy.random.RandomState``), the ones it does not ask are dropped. How the default
        sampler tells plans apart: several parameter sets can make one plan (streams are
        renumbered in the canonical form)."""
        trial = _Completing(params, rng)
        return self.plan(trial).canonical().dumps(), trial.params

    def _modes(self, candidate: str, cuts_before: Sequence[Cut]) -> tuple[str, tuple[str, ...]]:
        """The parameter name and choices of ``candidate``'s mode, given the cuts before it."""
        modes = self.modes[candidate]
        detach_ok = self.can_detach is None or self.can_detach(cuts_before, candidate)
        if detach_ok or "detach" not in modes:
            return f"{candidate}.mode", modes
        # A candidate whose own only choice is detach is kept until its upstream is covered.
        return f"{candidate}.mode_upstream", tuple(m for m in modes if m != "detach") or ("keep",)


def _choose(trial: Any, name: str, choices: Sequence[Any]) -> Any:
    return trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]


class _Params:
    """The trial parameters :meth:`BoundSpace.params` fixes for a plan, each value checked
    against the space's choices (a choice with one option is no parameter)."""

    def __init__(self, cuts: CutsSpec) -> None:
        self.cuts = cuts
        self.values: dict[str, Any] = {}

    def fix(self, name: str, value: Any, choices: Sequence[Any]) -> None:
        if value not in choices:
            raise SpaceError(f"{name}: {value!r} is not one of the space's choices {list(choices)}")
        if len(choices) > 1:
            self.values[name] = value

    def stream(self, name: str, value: int, low: int) -> None:
        s = self.cuts
        if s.streams == "round_robin":
            return  # not a parameter: the stream follows from the candidate
        if not low <= value <= s.max_streams:
            raise SpaceError(f"{name}: {value} is outside the space's streams {low}..{s.max_streams}")
        self.values[name] = value

    def cut(self, cut: Cut) -> None:
        """A cut's stream and auxiliary loss weight, where the space lets them vary."""
        c, s = cut.module, self.cuts
        if s.max_streams:
            self.stream(f"{c}.stream", cut.stream, 0)
        low, high = s.aux_weight.low, s.aux_weight.high
        if low < high:
            if not low <= cut.aux_weight <= high:
                raise SpaceError(f"{c}.aux_weight: {cut.aux_weight} is outside [{low}, {high}]")
            self.values[f"{c}.aux_weight"] = cut.aux_weight


class _Completing:
    """A trial answering from ``given`` where it can, drawing uniformly (log-uniformly for a
    log range) where it cannot; ``params`` holds what was asked."""

    def __init__(self, given: dict[str, Any], rng: Any) -> None:
        self._given, self._rng, self.params = given, rng, {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        value = self._given.get(name, _MISSING)
        if value is _MISSING or value not in choices:
            value = choices[self._rng.randint(len(choices))]
        self.params[name] = value
        return value

    def suggest_int(self, name: str, low: int, high: int) -> int:
        value = self._given.get(name, _MISSING)
        if not (isinstance(value, int) and low <= value <= high):
            value = int(self._rng.randint(low, high + 1))
        self.params[name] = value
        return value

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        value = self._given.get(name, _MISSING)
        if not (isinstance(value, (int, float)) and low <= value <= high):
            value = float(math.exp(self._rng.uniform(math.log(low), math.log(high))) if log
                          else self._rng.uniform(low, high))
        self.params[name] = value
        return value


_MISSING = object()
