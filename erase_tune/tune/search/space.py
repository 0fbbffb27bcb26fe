"""Search spaces: which plans a study may propose, read from ``search_spaces/*.yaml``.

A space names a workload and says which cut candidates may be detached, how many side
streams there are, which dispatch modes, per-cut and whole-step CUDA graphs, the aux-weight
range, FUP, the objectives, the NE-gap budget, the sampler, the per-trial budget and the
seed plans enqueued first. It is validated at load; every error names the file and field.

Each candidate gets one choice among keep / place on a side stream / detach on a stream /
graph (captured as a CUDA graph inside the eager step, not detached, on the main stream or a
side stream); which of them a candidate is offered is the space's ``modes``, or the
candidate's own (``{module: top_l, modes: [keep, place, graph]}``). The space is
conditional, so no trial is spent on a meaningless combination: a stream is only asked for a
placed, detached or graphed candidate, λ and the graph flag only for detached ones,
dispatch and per-cut graph flags only without a whole-step graph (launch order is fixed at
capture there), and a candidate overlapping one already used in the plan is not asked. Stream ids are
interchangeable, so every sampled plan is canonicalised (``ErasePlan.canonical``) and the
driver answers a repeat of an already measured plan from the study instead of re-running it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from erase_tune._files import load_yaml, read_text
from erase_tune.errors import EraseTuneError, one_line
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.plan import targets_overlap
from erase_tune.trial import Budget

__all__ = ["SearchSpace", "SpaceError", "MODES", "plan_params", "plan_key"]

MODES = ("keep", "place", "detach", "graph")
"""What a plan may do with a candidate: leave it, run it on a side stream (gradients
unchanged), detach it with a local loss on a stream (ERASE), or capture its forward and
backward as a CUDA graph replayed inside the eager step (gradients unchanged; on the main
stream or a side stream)."""


class SpaceError(EraseTuneError, ValueError):
    """A search-space file that is malformed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A validated search space (see the module docstring)."""

    source: str
    """The file it was read from (for messages)."""
    workload: str
    """Built-in workload name or ``package.module:factory``."""
    workload_args: Mapping[str, Any]
    candidates: tuple[str, ...]
    """Modules (or runs) a plan may place, detach or graph; empty = the workload's own candidates."""
    modes: tuple[str, ...]
    """Choices per candidate among :data:`MODES`, for a candidate without its own."""
    max_streams: int
    """Side streams available; a detached cut's or a graphed piece's stream is searched in
    0..max_streams, a placement's in 1..max_streams (with ``streams: searched``)."""
    streams: str
    """``searched`` or ``round_robin`` (candidate i on side stream 1 + i % max_streams)."""
    dispatch: tuple[str, ...]
    graph: tuple[bool, ...]
    """Choices of the per-cut CUDA-graph flag."""
    whole_step_graph: tuple[bool, ...]
    find_unused_parameters: tuple[bool, ...]
    aux_weight: tuple[float, float, bool]
    """(low, high, log) of each detached cut's λ."""
    max_ne_gap: float
    """Constraint: trials with a larger relative NE gap are infeasible."""
    gain_over: str
    """Which baseline ``qps_gain`` is measured against: ``eager`` or ``graph`` (GAIN_OVER)."""
    sampler: str
    sampler_seed: int | None
    budget: Budget
    """Per-trial budget (steps, windows; its seed is the space's ``seed``)."""
    timeout_s: float
    """A trial running longer is cancelled and recorded as failed."""
    trials: int
    """Default number of trials a job runs."""
    seed: int
    """Seed of weights and data in every trial (so trials are comparable)."""
    device: str
    seeds: tuple[tuple[str, ErasePlan], ...]
    """(name, plan) pairs enqueued before the sampler proposes anything."""
    working_dir: str | None = None
    """A directory shipped to the Ray workers (the workload's code), resolved against the file."""
    py_modules: tuple[str, ...] = ()
    """Package directories shipped to the Ray workers, resolved against the file."""
    gpus_per_trial: int = 1
    """Ranks of one trial (1..64): k > 1 runs k data-parallel ranks on one node (one GPU each,
    or one CPU each with ``device: cpu``), every variant's gradients averaged across them."""
    text: str = ""
    """The file's text, as given (stored with the job)."""
    candidate_modes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """A candidate's own choices among :data:`MODES`, where its entry gives them
    (``{module: top_l, modes: [keep, graph]}``); the others take :attr:`modes`."""

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> SearchSpace:
        text = read_text(path, "search space", SpaceError)
        return cls.loads(text, source=str(path), base=Path(path).parent)

    @classmethod
    def loads(cls, text: str, source: str = "<space>", base: Path | None = None) -> SearchSpace:
        """Parse a space; relative paths in it are resolved against ``base``."""
        from erase_tune.tune.search.space_file import parse

        data = load_yaml(text, source, SpaceError)
        source = one_line(source, 300)  # it prefixes every message about this space
        try:
            return cls(**parse(data, base or Path.cwd()), source=source, text=text)
        except EraseTuneError as e:
            raise SpaceError(f"{source}: {e}") from None

    # -- plans <-> trials --------------------------------------------------------------------

    @property
    def may_detach(self) -> bool:
        """Whether a plan of this space can detach anything (the workload's own candidates
        take :attr:`modes`)."""
        return "detach" in self.modes or any("detach" in m for m in self.candidate_modes.values())

    def modes_of(self, candidate: str) -> tuple[str, ...]:
        """The choices a plan of this space has for ``candidate``: its own, else :attr:`modes`."""
        return self.candidate_modes.get(candidate, self.modes)

    def plan_from_trial(self, trial: Any, candidates: Sequence[str], can_detach: Guard | None = None) -> ErasePlan:
        """Define-by-run: ask ``trial`` (an Optuna trial) for one plan of this space.

        ``can_detach(cuts so far, candidate)`` says whether detaching the candidate now would
        leave a parameter untrained (see :mod:`erase_tune.tune.search.checks`); where it would, the
        candidate is only offered its other modes (under another parameter name, so every
        name keeps one set of choices)."""
        whole = _choose(trial, "whole_step_graph", self.whole_step_graph)
        cuts: list[Cut] = []
        placed: list[Placement] = []
        graphed: list[Graphed] = []
        used: list[str] = []
        for c in candidates:
            if any(targets_overlap(c, u) for u in used):
                continue  # a module is in one plan element at most: this candidate is not asked
            name, modes = _modes(self.modes_of(c), c, can_detach is None or can_detach(cuts, c))
            mode = _choose(trial, name, modes)
            if mode != "keep":
                used.append(c)
            fixed = 1 + candidates.index(c) % self.max_streams if self.max_streams else 0
            rr = self.streams == "round_robin"
            if mode == "place" and self.max_streams:
                stream = fixed if rr else trial.suggest_int(f"{c}.place_stream", 1, self.max_streams)
                placed.append(Placement(module=c, stream=stream))
            elif mode == "detach":
                stream = fixed if rr or not self.max_streams else trial.suggest_int(f"{c}.stream", 0, self.max_streams)
                low, high, log = self.aux_weight
                weight = trial.suggest_float(f"{c}.aux_weight", low, high, log=log) if low < high else low
                cuts.append(Cut(module=c, stream=stream, aux_weight=weight))
            elif mode == "graph":
                # Under a whole-step graph the piece is in the step's graph already: canonical()
                # makes it a placement (side stream) or nothing (main stream), so the study
                # answers it from the equal plan it may have measured.
                stream = fixed if rr or not self.max_streams else trial.suggest_int(f"{c}.graph_stream", 0,
                                                                                    self.max_streams)
                graphed.append(Graphed(module=c, stream=stream))
        dispatch = "blocking"
        if cuts and not whole:
            dispatch = _choose(trial, "dispatch", self.dispatch)
            if dispatch != "deferred":  # a per-cut graph holds its backward: never deferred
                cuts = [dataclasses.replace(c, graph=_choose(trial, f"{c.module}.graph", self.graph)) for c in cuts]
        fup = _choose(trial, "find_unused_parameters", self.find_unused_parameters)
        plan = ErasePlan(cuts=tuple(cuts), placements=tuple(placed), graphs=tuple(graphed),
                         num_streams=self.max_streams, dispatch=dispatch, whole_step_graph=whole,
                         find_unused_parameters=fup)
        return plan.canonical()


Guard = Callable[[Sequence[Cut], str], bool]
"""``(cuts chosen so far, candidate) -> whether the candidate may be detached now``."""


def _modes(modes: tuple[str, ...], candidate: str, detach_ok: bool) -> tuple[str, tuple[str, ...]]:
    if detach_ok or "detach" not in modes:
        return f"{candidate}.mode", modes
    # A candidate whose own only choice is detach is kept until its upstream is covered.
    return f"{candidate}.mode_upstream", tuple(m for m in modes if m != "detach") or ("keep",)


def plan_key(space: SearchSpace, candidates: Sequence[str], can_detach: Guard | None = None
             ) -> Callable[[dict[str, Any], Any], tuple[str, dict[str, Any]]]:
    """``(params, rng) -> (canonical plan as YAML, the parameters that make it)``: the parameters a
    plan needs and ``params`` lacks (the space is conditional) are drawn at random (``rng``: a
    ``numpy.random.RandomState``), the ones it does not ask are dropped. How the default sampler
    tells plans apart: several parameter sets can make one plan (streams are renumbered in the
    canonical form)."""

    def key(params: dict[str, Any], rng: Any) -> tuple[str, dict[str, Any]]:
        trial = _Completing(params, rng)
        plan = space.plan_from_trial(trial, candidates, can_detach)
        return plan.canonical().dumps(), trial.params

    return key


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


def plan_params(space: SearchSpace, plan: ErasePlan, candidates: Sequence[str],
                can_detach: Guard | None = None) -> dict[str, Any]:
    """The trial parameters under which :meth:`SearchSpace.plan_from_trial` yields ``plan``
    (for ``study.enqueue_trial``); raises SpaceError if the plan lies outside the space."""
    cut_of = {c.module: c for c in plan.cuts}
    place_of = {p.module: p for p in plan.placements}
    graph_of = {g.module: g for g in plan.graphs}
    unknown = sorted((set(cut_of) | set(place_of) | set(graph_of)) - set(candidates))
    if unknown:
        raise SpaceError(f"{unknown[0]!r} is not among the space's candidates ({', '.join(candidates)})")
    params: dict[str, Any] = {}

    def fix(name: str, value: Any, choices: Sequence[Any]) -> None:
        if value not in choices:
            raise SpaceError(f"{name}: {value!r} is not one of the space's choices {list(choices)}")
        if len(choices) > 1:
            params[name] = value

    def stream(name: str, value: int, low: int) -> None:
        if space.streams == "round_robin":
            return  # not a parameter: the stream follows from the candidate
        if not low <= value <= space.max_streams:
            raise SpaceError(f"{name}: {value} is outside the space's streams {low}..{space.max_streams}")
        params[name] = value

    fix("whole_step_graph", plan.whole_step_graph, space.whole_step_graph)
    used: list[str] = []
    for c in candidates:
        if any(targets_overlap(c, u) for u in used):
            continue  # not asked by plan_from_trial either
        cut, placed, graphed = cut_of.get(c), place_of.get(c), graph_of.get(c)
        mode = "detach" if cut else "place" if placed else "graph" if graphed else "keep"
        so_far = [x for x in plan.cuts if candidates.index(x.module) < candidates.index(c)]
        name, modes = _modes(space.modes_of(c), c, can_detach is None or can_detach(so_far, c))
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
        if graphed is not None and space.max_streams:
            stream(f"{c}.graph_stream", graphed.stream, 0)
        if cut is None:
            continue
        if space.max_streams:
            stream(f"{c}.stream", cut.stream, 0)
        low, high, _ = space.aux_weight
        if low < high:
            if not low <= cut.aux_weight <= high:
                raise SpaceError(f"{c}.aux_weight: {cut.aux_weight} is outside [{low}, {high}]")
            params[f"{c}.aux_weight"] = cut.aux_weight
    if plan.cuts and not plan.whole_step_graph:
        fix("dispatch", plan.dispatch, space.dispatch)
        if plan.dispatch != "deferred":
            for cut in plan.cuts:
                fix(f"{cut.module}.graph", cut.graph, space.graph)
    fix("find_unused_parameters", plan.find_unused_parameters, space.find_unused_parameters)
    return params


def _choose(trial: Any, name: str, choices: Sequence[Any]) -> Any:
    return trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]
