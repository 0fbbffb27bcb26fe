"""Search spaces: which plans a study may propose, read from ``search_spaces/*.yaml``.

A space names a workload and says which cut candidates may be detached, how many side
streams there are, which dispatch modes, per-cut and whole-step CUDA graphs, the aux-weight
range, FUP, the objectives, the NE-gap budget, the sampler, the per-trial budget and the
seed plans enqueued first. It is validated at load; every error names the file and field.

The space is conditional, so no trial is spent on a meaningless combination: stream, λ
and graph flag are only asked for detached cuts; dispatch and per-cut graph flags only
without a whole-step graph (launch order is fixed at capture there). Stream ids are
interchangeable, so every sampled plan is canonicalised (``ErasePlan.canonical``) and the
driver answers a repeat of an already measured plan from the study instead of re-running it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from erase_tune._files import load_yaml, read_text
from erase_tune.errors import EraseTuneError, PlanError
from erase_tune.runtime import DISPATCH_MODES, Cut, ErasePlan
from erase_tune.trial import Budget

__all__ = ["SearchSpace", "SpaceError", "OBJECTIVES", "GAIN_OVER", "SAMPLERS", "plan_params"]

OBJECTIVES = ("qps_gain", "ne_gap")
"""Maximize the p90 QPS gain (over the baseline named by ``gain_over``); minimize the NE gap."""
GAIN_OVER = ("eager", "graph")
"""``eager``: over the eager baseline (no cuts). ``graph``: over the whole-step-graph
baseline, the honest competitor on a GPU and a far steadier ratio (the CPU-launch-bound
eager baseline drifts between windows and trials); CUDA only."""
SAMPLERS = ("tpe", "nsga2", "gp", "random")


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
    """Cut targets that may be detached (any subset); empty = the workload's own candidates."""
    max_streams: int
    """Side streams available; a detached cut's stream is searched in 0..max_streams."""
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
    text: str = ""
    """The file's text, as given (stored with the job)."""

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> SearchSpace:
        return cls.loads(read_text(path, "search space", SpaceError), source=str(path))

    @classmethod
    def loads(cls, text: str, source: str = "<space>") -> SearchSpace:
        data = load_yaml(text, source, SpaceError)
        try:
            return _parse(data, source, text)
        except EraseTuneError as e:
            raise SpaceError(f"{source}: {e}") from None

    # -- plans <-> trials --------------------------------------------------------------------

    def plan_from_trial(self, trial: Any, candidates: Sequence[str]) -> ErasePlan:
        """Define-by-run: ask ``trial`` (an Optuna trial) for one plan of this space."""
        whole = _choose(trial, "whole_step_graph", self.whole_step_graph)
        cuts: list[Cut] = []
        taken: set[str] = set()
        for c in candidates:
            members = Cut(module=c).members
            if any(_overlaps(m, t) for m in members for t in taken):
                continue  # a module can be in one cut only: this candidate is not asked
            if not trial.suggest_categorical(f"{c}.detach", [False, True]):
                continue
            taken.update(members)
            stream = trial.suggest_int(f"{c}.stream", 0, self.max_streams) if self.max_streams else 0
            low, high, log = self.aux_weight
            weight = trial.suggest_float(f"{c}.aux_weight", low, high, log=log) if low < high else low
            cuts.append(Cut(module=c, stream=stream, aux_weight=weight))
        dispatch = "blocking"
        if cuts and not whole:
            dispatch = _choose(trial, "dispatch", self.dispatch)
            if dispatch != "deferred":  # a per-cut graph holds its backward: never deferred
                cuts = [dataclasses.replace(c, graph=_choose(trial, f"{c.module}.graph", self.graph)) for c in cuts]
        fup = _choose(trial, "find_unused_parameters", self.find_unused_parameters)
        plan = ErasePlan(cuts=tuple(cuts), num_streams=self.max_streams, dispatch=dispatch,
                         whole_step_graph=whole, find_unused_parameters=fup)
        return plan.canonical()


def plan_params(space: SearchSpace, plan: ErasePlan, candidates: Sequence[str]) -> dict[str, Any]:
    """The trial parameters under which :meth:`SearchSpace.plan_from_trial` yields ``plan``
    (for ``study.enqueue_trial``); raises SpaceError if the plan lies outside the space."""
    by_module = {c.module: c for c in plan.cuts}
    unknown = sorted(set(by_module) - set(candidates))
    if unknown:
        raise SpaceError(f"cut {unknown[0]!r} is not among the space's candidates ({', '.join(candidates)})")
    params: dict[str, Any] = {}

    def fix(name: str, value: Any, choices: Sequence[Any]) -> None:
        if value not in choices:
            raise SpaceError(f"{name}: {value!r} is not one of the space's choices {list(choices)}")
        if len(choices) > 1:
            params[name] = value

    fix("whole_step_graph", plan.whole_step_graph, space.whole_step_graph)
    taken: set[str] = set()
    for c in candidates:
        members = Cut(module=c).members
        if any(_overlaps(m, t) for m in members for t in taken):
            continue  # not asked by plan_from_trial either
        cut = by_module.get(c)
        params[f"{c}.detach"] = cut is not None
        if cut is None:
            continue
        taken.update(members)
        if space.max_streams:
            if cut.stream > space.max_streams:
                raise SpaceError(f"{c}.stream: {cut.stream} exceeds the space's max_streams {space.max_streams}")
            params[f"{c}.stream"] = cut.stream
        low, high, log = space.aux_weight
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


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _choose(trial: Any, name: str, choices: Sequence[Any]) -> Any:
    return trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]


# -- parsing ---------------------------------------------------------------------------------

_TOP = {"workload", "cuts", "objectives", "gain_over", "max_ne_gap", "sampler", "budget", "trials", "seed", "device", "seeds"}
_CUTS = {"candidates", "max_streams", "dispatch", "graph", "whole_step_graph", "find_unused_parameters", "aux_weight"}


def _parse(data: Any, source: str, text: str) -> SearchSpace:
    if not isinstance(data, Mapping):
        raise SpaceError(f"a search space must be a mapping of fields, got {type(data).__name__}")
    _known(data, _TOP, "")
    wl = data.get("workload")
    if isinstance(wl, str):
        wl = {"name": wl}
    if not isinstance(wl, Mapping) or not isinstance(wl.get("name"), str) or not wl["name"]:
        raise SpaceError("workload.name: required (ctr, gpt, mlp or package.module:factory)")
    _known(wl, {"name", "args"}, "workload.")
    args = wl.get("args") or {}
    if not isinstance(args, Mapping):
        raise SpaceError("workload.args: must be a mapping of argument names to values")

    cuts = data.get("cuts") or {}
    if not isinstance(cuts, Mapping):
        raise SpaceError("cuts: must be a mapping")
    _known(cuts, _CUTS, "cuts.")
    candidates = cuts.get("candidates") or []
    if not isinstance(candidates, list) or not all(isinstance(c, str) and c for c in candidates):
        raise SpaceError("cuts.candidates: must be a list of module names (or runs like blocks.0:2)")
    if len(set(candidates)) != len(candidates):
        raise SpaceError("cuts.candidates: lists a module twice")
    for c in candidates:
        try:
            Cut(module=c)
        except PlanError as e:
            raise SpaceError(f"cuts.candidates: {e}") from None
    max_streams = _int(cuts.get("max_streams", 4), "cuts.max_streams", 0)
    dispatch = _choices(cuts.get("dispatch", ["blocking", "threaded"]), "cuts.dispatch", DISPATCH_MODES)
    graph = _bools(cuts.get("graph", [False]), "cuts.graph")
    whole = _bools(cuts.get("whole_step_graph", [False]), "cuts.whole_step_graph")
    fup = _bools(cuts.get("find_unused_parameters", [False]), "cuts.find_unused_parameters")
    aux = cuts.get("aux_weight", {"low": 1.0, "high": 1.0})
    if isinstance(aux, (int, float)) and not isinstance(aux, bool):
        aux = {"low": aux, "high": aux}
    if not isinstance(aux, Mapping):
        raise SpaceError("cuts.aux_weight: must be a number or {low, high, log}")
    _known(aux, {"low", "high", "log"}, "cuts.aux_weight.")
    low, high = _float(aux.get("low"), "cuts.aux_weight.low"), _float(aux.get("high"), "cuts.aux_weight.high")
    log = aux.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError("cuts.aux_weight.log: must be true or false")
    if not 0 < low <= high:
        raise SpaceError(f"cuts.aux_weight: need 0 < low <= high, got low={low}, high={high}")

    objectives = data.get("objectives", list(OBJECTIVES))
    if list(objectives or []) != list(OBJECTIVES):
        raise SpaceError(f"objectives: must be {list(OBJECTIVES)} (maximize qps_gain, minimize ne_gap)")
    gain_over = data.get("gain_over", "eager")
    if gain_over not in GAIN_OVER:
        raise SpaceError(f"gain_over: {gain_over!r} is not one of {', '.join(GAIN_OVER)}")
    device = data.get("device", "auto")
    if gain_over == "graph" and device == "cpu":
        raise SpaceError("gain_over: graph needs CUDA (the graph baseline does not exist on the CPU); use eager")
    max_ne_gap = _float(data.get("max_ne_gap", 0.02), "max_ne_gap")
    if max_ne_gap < 0:
        raise SpaceError(f"max_ne_gap: {max_ne_gap} must be >= 0")

    sampler = data.get("sampler", "tpe")
    if isinstance(sampler, str):
        sampler = {"name": sampler}
    if not isinstance(sampler, Mapping):
        raise SpaceError("sampler: must be a name or {name, seed}")
    _known(sampler, {"name", "seed"}, "sampler.")
    if sampler.get("name") not in SAMPLERS:
        raise SpaceError(f"sampler.name: {sampler.get('name')!r} is not one of {', '.join(SAMPLERS)}")
    sampler_seed = sampler.get("seed")
    if sampler_seed is not None:
        sampler_seed = _int(sampler_seed, "sampler.seed", 0)

    b = data.get("budget") or {}
    if not isinstance(b, Mapping):
        raise SpaceError("budget: must be a mapping")
    budget_fields = {"warmup_steps", "windows", "window_steps", "quality_steps", "timeout_s"}
    _known(b, budget_fields, "budget.")
    seed = _int(data.get("seed", 0), "seed", 0)
    budget = Budget(**{k: v for k, v in b.items() if k != "timeout_s"}, seed=seed)
    timeout_s = _float(b.get("timeout_s", 600), "budget.timeout_s")
    if timeout_s <= 0:
        raise SpaceError("budget.timeout_s: must be > 0")

    if device not in ("auto", "cpu", "cuda"):
        raise SpaceError(f"device: {device!r} is not one of auto, cpu, cuda")

    seeds = []
    for i, s in enumerate(data.get("seeds") or []):
        if not isinstance(s, Mapping) or "plan" not in s:
            raise SpaceError(f"seeds[{i}]: must be {{name, plan}}")
        _known(s, {"name", "plan"}, f"seeds[{i}].")
        try:
            plan = ErasePlan.from_dict(s["plan"] or {})
        except PlanError as e:
            raise SpaceError(f"seeds[{i}].plan.{e}") from None
        seeds.append((str(s.get("name", f"seed-{i}")), plan.canonical()))

    return SearchSpace(
        source=source, workload=wl["name"], workload_args=dict(args), candidates=tuple(candidates),
        max_streams=max_streams, dispatch=dispatch, graph=graph, whole_step_graph=whole,
        find_unused_parameters=fup, aux_weight=(low, high, log), max_ne_gap=max_ne_gap, gain_over=gain_over,
        sampler=sampler["name"], sampler_seed=sampler_seed, budget=budget, timeout_s=timeout_s,
        trials=_int(data.get("trials", 24), "trials", 1), seed=seed,
        device=device, seeds=tuple(seeds), text=text,
    )


def _known(data: Mapping, known: set[str], prefix: str) -> None:
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        raise SpaceError(f"{prefix}{unknown[0]}: unknown field (fields are: {', '.join(sorted(known))})")


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpaceError(f"{name}: {value!r} must be an integer >= {minimum}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpaceError(f"{name}: {value!r} must be a finite number")
    return float(value)


def _bools(value: Any, name: str) -> tuple[bool, ...]:
    if isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, bool) for v in value):
        raise SpaceError(f"{name}: must be true, false, or a list of them")
    return tuple(dict.fromkeys(value))


def _choices(value: Any, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise SpaceError(f"{name}: must be a non-empty list from {', '.join(allowed)}")
    for v in value:
        if v not in allowed:
            raise SpaceError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
    return tuple(dict.fromkeys(value))
