"""Search spaces: which plans a study may propose, read from ``search_spaces/*.yaml``.

A space names a workload and says which cut candidates may be detached, how many side
streams there are, which dispatch modes, per-cut and whole-step CUDA graphs, the aux-weight
range, FUP, the objectives, the NE-gap budget, the sampler, the per-trial budget and the
seed plans enqueued first.

:class:`SearchSpace` is the one schema of a space, from the file to the sampler: typed,
frozen, nested as the file is (:class:`WorkloadSpec`, :class:`CutsSpec` with its
:class:`Candidate` entries and :class:`AuxWeight`, :class:`SamplerSpec`, :class:`BudgetSpec`,
:class:`SeedPlan`), read by :meth:`SearchSpace.load` (a path) or :meth:`SearchSpace.loads`
(its text). Every reader takes a field where the file has it (``space.cuts.max_streams``,
``space.budget.per_trial``, ``space.workload.args``): nothing copies it into another shape.

Every field is checked for type and range before anything uses it, and every message is
one line naming the file and the field; values are shown with
:func:`~erase_tune.errors.shown`, so a megabyte-long string cannot flood it. Sizes that
reach memory or time are bounded here (stream counts, candidate counts, trial counts,
seeds), so a careless or hostile file is refused in milliseconds instead of failing deep
inside numpy or a trial. An absent field or ``null`` takes the default; any other value of
the wrong type (``seeds: 0``, ``budget: false``) is an error, not an empty default.

Each candidate gets one choice among keep / place on a side stream / detach on a stream /
graph; which of them a candidate is offered is the cuts' ``modes``, or the candidate's own
(``{module: top_l, modes: [keep, place, graph]}``). The codec between Optuna parameters and
plans is :class:`erase_tune.tune.search.codec.BoundSpace`, made once by
:func:`erase_tune.tune.search.checks.check_space` (``BoundSpace.unchecked`` binds a space to
known candidates without its model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from erase_tune._files import aux_weight_problem, load_yaml, read_text
from erase_tune.errors import EraseTuneError, PlanError, one_line, shown
from erase_tune.runtime import DISPATCH_MODES, Cut, ErasePlan
from erase_tune.runtime.plan import MAX_STREAMS, MAX_TARGETS
from erase_tune.measure.records import GAIN_OVER, MAX_CONFIRM_WINDOWS, MAX_STEPS, Budget
from erase_tune.tune.search.study import METRIC_NAMES, SAMPLERS
from erase_tune.workloads.limits import MAX_SEED

__all__ = ["SearchSpace", "WorkloadSpec", "CutsSpec", "Candidate", "AuxWeight", "SamplerSpec", "BudgetSpec",
           "SeedPlan", "SpaceError", "MAX_TRIALS", "MAX_SEED", "MAX_NE_GAP", "MODES", "STREAMS"]

MAX_TRIALS = 100_000
"""numpy's seed range: a larger sampler seed would fail only after the study was written."""
_TOP = {"workload", "cuts", "objectives", "gain_over", "max_ne_gap", "sampler", "budget", "trials", "seed", "device",
        "seeds", "gpus_per_trial"}
MAX_NE_GAP = 100.0
"""Largest NE-gap budget (``max_ne_gap``; export's ``--max-ne-gap`` too): 100 is 10000%."""
MAX_GPUS_PER_TRIAL = 64
"""Most ranks one data-parallel trial may ask for (all on one node)."""
_CUTS = {"candidates", "modes", "max_streams", "streams", "dispatch", "graph", "whole_step_graph",
         "find_unused_parameters", "aux_weight"}
MODES = ("keep", "place", "detach", "graph")
"""What a plan may do with a candidate: leave it, run it on a side stream (gradients
unchanged), detach it with a local loss on a stream (ERASE), or capture its forward and
backward as a CUDA graph replayed inside the eager step (gradients unchanged; on the main
stream or a side stream)."""
STREAMS = ("searched", "round_robin")
"""``searched``: each placed or detached candidate's stream is a search parameter.
``round_robin``: candidate i always runs on side stream 1 + i % max_streams (fewer plans)."""


class SpaceError(EraseTuneError, ValueError):
    """A search-space file that is malformed (or a plan outside its space)."""


class _Error(EraseTuneError, ValueError):
    """One field's problem, before the file's name prefixes it."""


# -- the schema --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """``workload:``: what the trials train, and the code shipped to the Ray workers."""

    name: str
    """Built-in workload name or ``package.module:factory``."""
    args: Mapping[str, Any]
    """The factory's keyword arguments."""
    working_dir: str | None = None
    """A directory shipped to the Ray workers (the workload's code), resolved against the file's directory."""
    py_modules: tuple[str, ...] = ()
    """Package directories shipped to the Ray workers, resolved against the file's directory."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One entry of ``cuts.candidates``: a target (``top_l``, ``blocks.0:2``), and its own modes
    where the entry gives them (``{module: top_l, modes: [keep, graph]}``)."""

    module: str
    modes: tuple[str, ...] | None = None
    """Its own choices among :data:`MODES`; None: the cuts' :attr:`CutsSpec.modes`."""


@dataclasses.dataclass(frozen=True)
class AuxWeight:
    """``cuts.aux_weight``: the range of each detached cut's λ."""

    low: float
    high: float
    log: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class CutsSpec:
    """``cuts:``: which candidates, which modes, and the choices of the plan's flags."""

    candidates: tuple[Candidate, ...]
    """Modules (or runs) a plan may place, detach or graph; empty: the workload's own candidates."""
    modes: tuple[str, ...]
    """Choices per candidate among :data:`MODES`, for a candidate without its own."""
    max_streams: int
    """Side streams available; a detached cut's or a graphed piece's stream is searched in
    0..max_streams, a placement's in 1..max_streams (with ``streams: searched``)."""
    streams: str
    """One of :data:`STREAMS` (``round_robin``: candidate i on side stream 1 + i % max_streams)."""
    dispatch: tuple[str, ...]
    graph: tuple[bool, ...]
    """Choices of the per-cut CUDA-graph flag."""
    whole_step_graph: tuple[bool, ...]
    find_unused_parameters: tuple[bool, ...]
    aux_weight: AuxWeight

    @property
    def modules(self) -> tuple[str, ...]:
        """The listed candidates' targets, in order (empty: the workload's own candidates)."""
        return tuple(c.module for c in self.candidates)

    def own_modes(self, candidate: str) -> tuple[str, ...] | None:
        """``candidate``'s own choices where its entry gives them, else None (it takes :attr:`modes`)."""
        return next((c.modes for c in self.candidates if c.module == candidate), None)


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """``sampler:``: a name among the study's samplers, its seed (None: drawn), and whether the
    structural screen runs before it."""

    name: str
    seed: int | None = None
    screen: bool = True
    """Measure each single structural change, then unions of those that gained, before the
    sampler proposes (erase_tune.tune.search.screen)."""


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
    """``budget:``: what one trial may spend."""

    per_trial: Budget
    """Steps and windows (its seed is the space's ``seed``)."""
    timeout_s: float
    """A trial running longer is cancelled and recorded as failed."""
    confirm_max_windows: int = 40
    """Windows a re-measurement of the front (the end of ``start``, ``export``) takes at most:
    it stops earlier once each gain's interval is within ±2 points (a host-bound step needs
    about 30 windows for that; a noisy CPU may never get there)."""


@dataclasses.dataclass(frozen=True)
class SeedPlan:
    """One entry of ``seeds:``: a plan enqueued before the sampler proposes anything."""

    name: str
    plan: ErasePlan
    """Canonical."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A search space, every field checked (see the module docstring)."""

    workload: WorkloadSpec
    cuts: CutsSpec
    sampler: SamplerSpec
    budget: BudgetSpec
    gain_over: str
    """Which baseline ``qps_gain`` is measured against: ``eager`` or ``graph`` (GAIN_OVER)."""
    max_ne_gap: float
    """Constraint: trials with a larger relative NE gap are infeasible."""
    device: str
    """``auto``, ``cpu`` or ``cuda``."""
    gpus_per_trial: int
    """Ranks of one trial (1..64): k > 1 runs k data-parallel ranks on one node (one GPU each,
    or one CPU each with ``device: cpu``), every variant's gradients averaged across them."""
    seed: int
    """Seed of weights and data in every trial (so trials are comparable)."""
    seeds: tuple[SeedPlan, ...]
    """Plans enqueued, in order, before the sampler proposes anything."""
    trials: int
    """Default number of trials a job runs."""
    source: str = "<space>"
    """Where it was read from, one line (it prefixes every message about the space)."""
    text: str = ""
    """The file's text, as given (stored with the job)."""

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> SearchSpace:
        """The space in the file at ``path`` (relative paths in it resolved against its directory)."""
        text = read_text(path, "search space", SpaceError)
        return cls.loads(text, source=str(path), base=Path(path).parent)

    @classmethod
    def loads(cls, text: str, source: str = "<space>", base: Path | None = None) -> SearchSpace:
        """A space's text; relative paths in it are resolved against ``base`` (else the working
        directory). Every error is one :class:`SpaceError` line prefixed by ``source``."""
        data = load_yaml(text, source, SpaceError)
        source = one_line(source, 300)  # it prefixes every message about this space
        try:
            return dataclasses.replace(_parse(data, base or Path.cwd()), source=source, text=text)
        except EraseTuneError as e:
            raise SpaceError(f"{source}: {e}") from None

    def with_budget(self, **changes: Any) -> SearchSpace:
        """This space with ``changes`` to its per-trial budget (fields of
        :class:`~erase_tune.measure.trial.Budget`)."""
        per_trial = dataclasses.replace(self.budget.per_trial, **changes)
        return dataclasses.replace(self, budget=dataclasses.replace(self.budget, per_trial=per_trial))

    # -- the candidates' modes ----------------------------------------------------------------

    @property
    def may_detach(self) -> bool:
        """Whether a plan of this space can detach anything (the workload's own candidates
        take the cuts' ``modes``)."""
        return "detach" in self.cuts.modes or any(c.modes is not None and "detach" in c.modes
                                                  for c in self.cuts.candidates)

    def modes_of(self, candidate: str) -> tuple[str, ...]:
        """The choices a plan of this space has for ``candidate``: its own, else the cuts' ``modes``
        (a bound space resolves them so for each of its candidates: ``BoundSpace.modes``)."""
        own = self.cuts.own_modes(candidate)
        return self.cuts.modes if own is None else own


# -- reading -----------------------------------------------------------------------------------


def _parse(data: Any, base: Path) -> SearchSpace:
    """The :class:`SearchSpace` of parsed YAML ``data`` (but its source and text), or one
    line naming the field."""
    data = _mapping(data, "", "a search space")
    _known(data, _TOP, "")
    workload = _workload(data.get("workload"), base)
    cuts = _cuts(_or(data.get("cuts"), {}))
    objectives = data.get("objectives", list(METRIC_NAMES))
    if not isinstance(objectives, list) or objectives != list(METRIC_NAMES):
        raise _Error(f"objectives: must be {list(METRIC_NAMES)} (maximize qps_gain, minimize ne_gap)")
    gain_over = data.get("gain_over", "eager")
    if gain_over not in GAIN_OVER:
        raise _Error(f"gain_over: {shown(gain_over)} is not one of {', '.join(GAIN_OVER)}")
    device = data.get("device", "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise _Error(f"device: {shown(device)} is not one of auto, cpu, cuda")
    if gain_over == "graph" and device == "cpu":
        raise _Error("gain_over: graph needs CUDA (the graph baseline does not exist on the CPU); use eager")
    gpus_per_trial = _int(data.get("gpus_per_trial", 1), "gpus_per_trial", 1, MAX_GPUS_PER_TRIAL)
    max_ne_gap = _float(data.get("max_ne_gap", 0.02), "max_ne_gap")
    if not 0 <= max_ne_gap <= MAX_NE_GAP:
        raise _Error(f"max_ne_gap: {max_ne_gap} must be between 0 and {MAX_NE_GAP:g}")
    sampler = _sampler(data.get("sampler", "front"))
    budget, seed = _budget(_or(data.get("budget"), {}), data.get("seed", 0))
    seeds = _seeds(_or(data.get("seeds"), []))
    return SearchSpace(workload=workload, cuts=cuts, gain_over=gain_over, max_ne_gap=max_ne_gap, device=device,
                       gpus_per_trial=gpus_per_trial, sampler=sampler, budget=budget, seed=seed, seeds=seeds,
                       trials=_int(data.get("trials", 24), "trials", 1, MAX_TRIALS))


def _workload(wl: Any, base: Path) -> WorkloadSpec:
    if isinstance(wl, str):
        wl = {"name": wl}
    wl = _mapping(wl, "workload", "{name, args}")
    _known(wl, {"name", "args", "working_dir", "py_modules"}, "workload.")
    if not isinstance(wl.get("name"), str) or not wl["name"].strip():
        raise _Error("workload.name: required (ctr, gpt, mlp, dlrm or package.module:factory)")
    args = _mapping(_or(wl.get("args"), {}), "workload.args", "a mapping of argument names to values")
    working_dir = None if wl.get("working_dir") is None else _path(wl["working_dir"], "workload.working_dir", base)
    py_modules = _or(wl.get("py_modules"), [])
    if not isinstance(py_modules, list):
        raise _Error("workload.py_modules: must be a list of package directories")
    py_modules = [_path(p, f"workload.py_modules[{i}]", base) for i, p in enumerate(py_modules)]
    return WorkloadSpec(name=wl["name"], args=dict(args), working_dir=working_dir, py_modules=tuple(py_modules))


def _cuts(cuts: Any) -> CutsSpec:
    cuts = _mapping(cuts, "cuts", "a mapping")
    _known(cuts, _CUTS, "cuts.")
    max_streams = _int(cuts.get("max_streams", 4), "cuts.max_streams", 0, MAX_STREAMS)
    modes = _modes(cuts.get("modes", ["keep", "place", "detach"] if max_streams else ["keep", "detach"]),
                   "cuts.modes", max_streams)
    candidates = _candidates(_or(cuts.get("candidates"), []), max_streams)
    streams = cuts.get("streams", "searched")
    if streams not in STREAMS:
        raise _Error(f"cuts.streams: {shown(streams)} is not one of {', '.join(STREAMS)}")
    return CutsSpec(
        candidates=candidates, modes=modes, max_streams=max_streams, streams=streams,
        dispatch=_choices(cuts.get("dispatch", ["blocking", "threaded"]), "cuts.dispatch", DISPATCH_MODES),
        graph=_bools(cuts.get("graph", [False]), "cuts.graph"),
        whole_step_graph=_bools(cuts.get("whole_step_graph", [False]), "cuts.whole_step_graph"),
        find_unused_parameters=_bools(cuts.get("find_unused_parameters", [False]), "cuts.find_unused_parameters"),
        aux_weight=_aux_weight(cuts.get("aux_weight", {"low": 1.0, "high": 1.0})),
    )


def _aux_weight(aux: Any) -> AuxWeight:
    if isinstance(aux, (int, float)) and not isinstance(aux, bool):
        aux = {"low": aux, "high": aux}
    aux = _mapping(aux, "cuts.aux_weight", "a number or {low, high, log}")
    _known(aux, {"low", "high", "log"}, "cuts.aux_weight.")
    low, high = _float(aux.get("low"), "cuts.aux_weight.low"), _float(aux.get("high"), "cuts.aux_weight.high")
    log = aux.get("log", False)
    if not isinstance(log, bool):
        raise _Error("cuts.aux_weight.log: must be true or false")
    if not 0 < low <= high <= 1e6:
        raise _Error(f"cuts.aux_weight: need 0 < low <= high <= 1e6, got low={low}, high={high}")
    for bound, value in (("low", low), ("high", high)):  # a λ every plan of the space can train with
        if problem := aux_weight_problem(value):
            raise _Error(f"cuts.aux_weight.{bound}: {shown(value)} {problem}")
    return AuxWeight(low, high, log)


def _sampler(sampler: Any) -> SamplerSpec:
    if isinstance(sampler, str):
        sampler = {"name": sampler}
    sampler = _mapping(sampler, "sampler", "a name or {name, seed, screen}")
    _known(sampler, {"name", "seed", "screen"}, "sampler.")
    if sampler.get("name") not in SAMPLERS:
        raise _Error(f"sampler.name: {shown(sampler.get('name'))} is not one of {', '.join(SAMPLERS)}")
    seed = sampler.get("seed")
    screen = _or(sampler.get("screen"), True)
    if not isinstance(screen, bool):
        raise _Error(f"sampler.screen: {shown(screen)} must be true or false")
    return SamplerSpec(sampler["name"], None if seed is None else _int(seed, "sampler.seed", 0, MAX_SEED), screen)


def _budget(b: Any, seed: Any) -> tuple[BudgetSpec, int]:
    """The budget, and the file's ``seed`` (checked here, after the budget's fields: its seed)."""
    b = _mapping(b, "budget", "a mapping")
    _known(b, {"warmup_steps", "windows", "max_windows", "halfwidth", "window_steps", "quality_steps", "timeout_s",
               "noise_repeats", "quality_scale", "quality_seeds", "confirm_max_windows"}, "budget.")
    seed = _int(seed, "seed", 0, MAX_SEED)
    steps = {k: _int(v, f"budget.{k}", 0, MAX_STEPS) for k, v in b.items() if k not in ("timeout_s", "halfwidth", "confirm_max_windows")}
    if "halfwidth" in b:
        halfwidth = _float(b["halfwidth"], "budget.halfwidth")
        if not 0 < halfwidth < 1:
            raise _Error(f"budget.halfwidth: {halfwidth} must be in (0, 1): the 95% interval's half-width a trial "
                         "measures its gain to (0.03: ±3 points)")
        steps["halfwidth"] = halfwidth
    if "windows" in steps and "max_windows" not in steps:  # a file written for fixed windows keeps its length
        steps["max_windows"] = max(steps["windows"], Budget().max_windows)
    per_trial = Budget(**steps, seed=seed)
    timeout_s = _float(b.get("timeout_s", 600), "budget.timeout_s")
    if not 0 < timeout_s <= 7 * 86400:
        raise _Error("budget.timeout_s: must be > 0 and at most a week")
    confirm_max = _int(b.get("confirm_max_windows", BudgetSpec.confirm_max_windows), "budget.confirm_max_windows", 2,
                       MAX_CONFIRM_WINDOWS)
    return BudgetSpec(per_trial, timeout_s, confirm_max), seed


def _seeds(raw: Any) -> tuple[SeedPlan, ...]:
    if not isinstance(raw, list):
        raise _Error("seeds: must be a list of {name, plan}")
    seeds = []
    for i, s in enumerate(raw):
        if not isinstance(s, Mapping) or "plan" not in s:
            raise _Error(f"seeds[{i}]: must be {{name, plan}}")
        _known(s, {"name", "plan"}, f"seeds[{i}].")
        name = s.get("name", f"seed-{i}")
        if not isinstance(name, str) or not name.strip():
            raise _Error(f"seeds[{i}].name: {shown(name)} must be a non-empty string")
        try:
            plan = ErasePlan.from_dict(_or(s["plan"], {}))
        except PlanError as e:
            raise _Error(f"seeds[{i}].plan.{e}") from None
        seeds.append(SeedPlan(name, plan.canonical()))
    return tuple(seeds)


def _candidates(raw: Any, max_streams: int) -> tuple[Candidate, ...]:
    """The candidates, each with its own modes where its entry gives them.

    An entry is a target (``top_l``, ``blocks.0:2``) or ``{module: top_l, modes: [...]}``."""
    if not isinstance(raw, list):
        raise _Error("cuts.candidates: must be a list of module names (or runs like blocks.0:2) "
                     "or {module, modes} entries")
    if len(raw) > MAX_TARGETS:
        raise _Error(f"cuts.candidates: {len(raw)} candidates; at most {MAX_TARGETS}")
    out: list[Candidate] = []
    for i, entry in enumerate(raw):
        where = f"cuts.candidates[{i}]"
        if isinstance(entry, Mapping):
            entry = _mapping(entry, where, "{module, modes}")
            _known(entry, {"module", "modes"}, f"{where}.")
            module = entry.get("module")
            if not isinstance(module, str) or not module:
                raise _Error(f"{where}.module: {shown(module)} must be a module name (or a run like blocks.0:2)")
            modes = None if entry.get("modes") is None else _modes(entry["modes"], f"{where}.modes", max_streams)
        elif isinstance(entry, str) and entry:
            module, modes = entry, None
        else:
            raise _Error(f"{where}: {shown(entry)} must be a module name (or a run like blocks.0:2) "
                         "or {module, modes}")
        try:
            Cut(module=module)
        except PlanError as e:
            raise _Error(f"cuts.candidates: {e}") from None
        if any(c.module == module for c in out):
            raise _Error(f"cuts.candidates: lists {shown(module)} twice")
        out.append(Candidate(module, modes))
    return tuple(out)


def _modes(value: Any, name: str, max_streams: int) -> tuple[str, ...]:
    modes = _choices(value, name, MODES)
    if "place" in modes and not max_streams:
        raise _Error(f"{name}: place needs side streams (cuts.max_streams >= 1)")
    return modes


def _or(value: Any, default: Any) -> Any:
    """``default`` for an absent or null field; any other value as it is, to be checked."""
    return default if value is None else value


def _mapping(value: Any, name: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _Error(f"{name or 'the file'}: must be {what}, got {type(value).__name__}")
    bad = next((k for k in value if not isinstance(k, str)), None)
    if bad is not None:
        raise _Error(f"{name + '.' if name else ''}{shown(bad)}: field names must be strings")
    return value


def _known(data: Mapping, known: set[str], prefix: str) -> None:
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise _Error(f"{prefix}{shown(unknown[0])}: unknown field (fields are: {', '.join(sorted(known))})")


def _int(value: Any, name: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        huge = isinstance(value, int) and abs(value) >= 10**12
        raise _Error(f"{name}: {'a huge integer' if huge else shown(value)} must be an integer in {minimum}..{maximum}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Error(f"{name}: {shown(value)} must be a finite number")
    try:
        value = float(value)
    except OverflowError:
        raise _Error(f"{name}: must be a finite number") from None
    if not math.isfinite(value):
        raise _Error(f"{name}: {shown(value)} must be a finite number")
    return value


def _path(value: Any, name: str, base: Path) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise _Error(f"{name}: {shown(value)} must be a directory path")
    return str((base / value).resolve())


def _bools(value: Any, name: str) -> tuple[bool, ...]:
    if isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, bool) for v in value):
        raise _Error(f"{name}: must be true, false, or a list of them")
    return tuple(dict.fromkeys(value))


def _choices(value: Any, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _Error(f"{name}: must be a non-empty list from {', '.join(allowed)}")
    for v in value:
        if v not in allowed:
            raise _Error(f"{name}: {shown(v)} is not one of {', '.join(allowed)}")
    return tuple(dict.fromkeys(value))
