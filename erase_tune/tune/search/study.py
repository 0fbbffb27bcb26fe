"""The Optuna side: one multi-objective study per job, and the names everything reads it by.

Objectives are ``qps_gain`` (maximize: p90 QPS gain over the baseline the space's
``gain_over`` names) and ``ne_gap`` (minimize: relative NE gap); their names are set on the
study so optuna-dashboard labels them. The NE budget is a constraint, ``ne_gap - (max_ne_gap
+ band) <= 0`` where ``band`` is the study's measured noise floor (erase_tune.measure.noise; 0 before
it is measured), and ``-max_ne_gap`` for a plan exact by construction (no cuts), stored once in the trial's ``constraints`` system attribute: Optuna 5's samplers and
``study.best_trials`` read it, and so does optuna-dashboard 0.21 (which does not read the
per-key form ``trial.set_constraint`` writes). Each measured number is its own scalar user
attribute (:class:`Attr`), so the dashboard can sort and plot by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from erase_tune.errors import EraseTuneError, shown
from erase_tune.measure.records import TrialResult
from erase_tune.store.storage import CONSTRAINTS, Storage

__all__ = ["METRIC_NAMES", "DIRECTIONS", "CONSTRAINTS", "Attr", "SAMPLERS", "make_sampler", "open_study", "load_study",
           "metric_attrs", "objective_values", "flat_attrs", "attr", "FrontPoint", "pareto_front", "measured",
           "check_stored_attrs",
           "noise_band", "constraint", "finalists"]

METRIC_NAMES = ("qps_gain", "ne_gap")
DIRECTIONS = ("maximize", "minimize")
SAMPLERS = ("front", "tpe", "nsga2", "gp", "random")
"""``front`` (the default: erase_tune.tune.search.samplers.FrontSampler) and Optuna's TPE, NSGA-II, GP, random."""


class Attr:
    """User-attribute names on trials and studies (one place, so readers and writers agree)."""

    PLAN = "plan"  # the canonical plan, as a dict
    PLAN_KEY = "plan_key"  # canonical YAML: how repeats are recognised
    PLAN_SUMMARY = "plan_summary"
    SEED_NAME = "seed_name"
    DUPLICATE_OF = "duplicate_of"  # a repeat of an earlier trial's plan, not run again
    FAILURE_KIND = "failure_kind"  # "trial" or "infra"
    FAILURE = "failure_reason"
    ATTEMPTS = "attempts"
    DEVICE = "device"
    NODE = "ray_node"
    DURATION = "duration_s"
    MAX_NE_GAP = "max_ne_gap"
    FEASIBLE = "feasible"
    EXACT = "exact"  # no cuts: exact by construction, its measured NE gap is noise (objective 0)
    PHASE = "phase"  # seed, screen-single, screen-union or search (erase_tune.tune.search.screen.PHASES)
    SCREEN_NAME = "screen_name"  # the structural screen's name of the plan: "graph top_l", "place a + cut b"
    # study-level
    WORKLOAD = "workload"
    GAIN_OVER = "gain_over"
    DRIVERS = "drivers_started"
    NOISE_FLOOR = "noise_floor"  # erase_tune.measure.noise.NoiseFloor.to_dict()
    NOISE_BAND = "ne_noise_band"  # its band, a scalar the dashboard lists
    REFERENCE_ERROR = "reference_error"  # why the whole-step graph cannot be captured; None: it can (CUDA only)
    STEP_COST = "step_cost"  # the preflight's erase_tune.measure.estimate.StepCost, as a dict
    QUALITY_LEFT_OUT = "quality_left_out"  # the job's time budget left no time to confirm NE gaps


_OLD_METRICS = {"gain_vs_eager": "gain_p90", "gain_vs_graph": "gain_vs_reference"}
"""Studies written before the metrics were flat kept them in one ``metrics`` dict."""


def make_sampler(name: str, seed: int | None, max_ne_gap: float | None = None,
                 plan_key: Callable[[dict[str, Any], Any], tuple[str, dict[str, Any]]] | None = None,
                 ) -> optuna.samplers.BaseSampler:
    """A sampler by name; all but random honour the NE constraint. ``front`` is the default,
    chosen by replayed studies on H200 measurements (docs/benchmarks.md, "Tuner efficiency");
    it measures the hypervolume within ``max_ne_gap`` and tells plans apart by ``plan_key``
    (erase_tune.tune.search.codec.BoundSpace.key)."""
    if name == "front":
        from erase_tune.tune.search.samplers import FrontSampler

        return FrontSampler(seed=seed, max_ne_gap=max_ne_gap, plan_key=plan_key)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=8)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise EraseTuneError(f"sampler: {name!r} is not one of {', '.join(SAMPLERS)}")


def open_study(db: Storage, study_name: str, *, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    """Create the job's study, or load it to resume; objective names are set either way."""
    study = db.study(study_name, directions=DIRECTIONS, sampler=sampler)
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
        raise EraseTuneError(f"study {shown(study_name)} exists with other objectives; choose another study name")
    if study.metric_names != list(METRIC_NAMES):
        study.set_metric_names(list(METRIC_NAMES))
    return study


def metric_attrs(result: TrialResult) -> dict[str, float | str]:
    """The flat numbers a trial records (sortable in the dashboard); no samples.

    ``gain_vs_eager`` and ``gain_vs_graph`` are the robust estimates the study ranks by: the
    mean of the per-window gains of the interleaved protocol (erase_tune.measure.protocol), with
    ``gain_lo``/``gain_hi`` its 95% interval (of the pair the stop rule read), ``windows`` the
    rounds it took and ``stopped`` why it stopped. ``gain_p90`` is the paper's statistic (p90 of
    the pooled per-step QPS), kept beside it; ``exact_diff`` the exactness check's largest
    relative gradient difference, where it ran."""
    ref = result.gain_vs_reference_interval
    over_graph = result.provenance.get("gain_over") == "graph"
    out: dict[str, float | str | None] = {
        "gain_vs_eager": None if over_graph else result.gain,
        "gain_vs_graph": result.gain if over_graph else ref[0] if ref is not None else None,
        "gain_lo": result.gain_lo, "gain_hi": result.gain_hi, "windows": result.windows, "stopped": result.stopped,
        "gain_p90": result.gain_p90, "gain_median": result.gain_median,
        "gain_detach_only": result.gain_detach_only, "exact_diff": result.exact_diff,
        "ne_baseline": result.ne_baseline, "ne_candidate": result.ne_candidate, "ne_gap": result.ne_gap,
    }
    for task, ne in (result.ne_tasks or {}).items():  # a multi-task workload: each task's gap (ne_gap: the main's)
        out[f"ne_gap.{task}"] = ne["gap"]
    for name, v in result.variants.items():
        out[f"{name}_p90_qps"], out[f"{name}_median_qps"] = v.p90_qps, v.median_qps
    return {k: (v if isinstance(v, str) else float(v)) for k, v in out.items() if v is not None}


def objective_values(attrs: dict[str, Any], gain_over: str) -> list[float]:
    """``[qps_gain, ne_gap]`` from a trial's metric attributes; ``gain_over`` picks the baseline."""
    gain = attrs.get("gain_vs_eager" if gain_over == "eager" else "gain_vs_graph")
    if gain is None:
        raise EraseTuneError("no whole-step-graph baseline was measured (a CPU trial?): gain_over: graph needs CUDA")
    return [float(gain), float(attrs["ne_gap"])]


def flat_attrs(user_attrs: dict[str, Any]) -> dict[str, Any]:
    """A trial's user attributes in the current names; an older study's nested ``metrics``
    dict fills the gaps."""
    attrs = dict(user_attrs)
    legacy = attrs.get("metrics")
    if isinstance(legacy, dict):
        for key, value in legacy.items():
            attrs.setdefault(key, value)
        for new, old in _OLD_METRICS.items():
            if attrs.get(new) is None:
                attrs[new] = legacy.get(old)
    return attrs


def attr(t: FrozenTrial, name: str) -> Any:
    """A trial's metric attribute, also from studies that kept metrics in one dict."""
    return flat_attrs(t.user_attrs).get(name)


def measured(study: optuna.Study, trials: Sequence[FrozenTrial] | None = None) -> list[FrozenTrial]:
    """Complete trials that were really run (repeats of a measured plan excluded), of ``trials``
    when the caller has read them already (one read of the storage, not one per question)."""
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None and Attr.PLAN in t.user_attrs
            and Attr.DUPLICATE_OF not in t.user_attrs]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontPoint:
    """One Pareto-optimal trial."""

    number: int
    qps_gain: float
    """The study's objective: gain over the baseline the job's ``gain_over`` names."""
    ne_gap: float
    gain_vs_eager: float | None
    gain_vs_graph: float | None
    gain_detach_only: float | None
    plan: dict[str, Any]
    user_attrs: dict[str, Any]


def noise_band(study: optuna.Study) -> float:
    """The study's noise floor band (0 when none was measured: an older study, or noise_repeats 0)."""
    band = study.user_attrs.get(Attr.NOISE_BAND)
    return float(band) if isinstance(band, (int, float)) and band >= 0 else 0.0


def constraint(ne_gap: float, max_ne_gap: float, band: float = 0.0, *, exact: bool = False) -> float:
    """The value stored in ``constraints``: <= 0 when feasible (erase_tune.measure.noise.feasible)."""
    return -max_ne_gap if exact else ne_gap - (max_ne_gap + band)


def pareto_front(study: optuna.Study, max_ne_gap: float | None = None,
                 trials: Sequence[FrozenTrial] | None = None) -> list[FrontPoint]:
    """Measured trials not dominated in (max qps_gain, min ne_gap), best gain first; with
    ``max_ne_gap``, only trials within that NE gap beyond the study's noise floor
    (:func:`noise_band`) take part.

    NE gaps that differ by no more than the noise floor count as equal: a plan is dominated by
    one at least as fast whose gap is not worse beyond the band, so a slower plan never stays on
    the front for a noise-level NE edge (an exact plan at gap 0 and a cut at -0.4% within a ±0.5%
    floor are equal in quality, and the faster one wins). ``trials``: the study's, when read already."""
    trials = measured(study, trials)
    band = noise_band(study)
    if max_ne_gap is not None:
        trials = [t for t in trials if t.values[1] <= max_ne_gap + band]
    front = [t for t in trials if not any(_dominates(o.values, t.values, band) for o in trials)]
    seen, points = set(), []
    for t in sorted(front, key=lambda t: (-t.values[0], t.values[1], t.number)):
        if tuple(t.values) in seen:
            continue
        seen.add(tuple(t.values))
        points.append(FrontPoint(number=t.number, qps_gain=t.values[0], ne_gap=t.values[1],
                                 gain_vs_eager=attr(t, "gain_vs_eager"), gain_vs_graph=attr(t, "gain_vs_graph"),
                                 gain_detach_only=attr(t, "gain_detach_only"), plan=t.user_attrs[Attr.PLAN],
                                 user_attrs=dict(t.user_attrs)))
    return points


def finalists(study: optuna.Study, max_ne_gap: float | None, k: int) -> list[FrontPoint]:
    """The plans a job confirms: the front (within ``max_ne_gap``), then the best plan its trial
    verified exact (it needs no NE confirmation, so it can be exported whatever time is left), then
    the next-best measured plans within the budget by search gain, up to ``k`` in all. Exact plans
    share NE gap 0, so the front of a study of graphs and placements is often its one best
    reading; the runners-up are confirmed beside it, so a lucky reading cannot be the only one."""
    front = pareto_front(study, max_ne_gap)[:k]
    taken = {p.number for p in front}
    limit = None if max_ne_gap is None else max_ne_gap + noise_band(study)
    rest = sorted((t for t in measured(study) if t.number not in taken and (limit is None or t.values[1] <= limit)),
                  key=lambda t: (-t.values[0], t.values[1], t.number))
    exact = next((t for t in rest if t.user_attrs.get(Attr.EXACT)), None)
    if exact is not None and not any(p.user_attrs.get(Attr.EXACT) for p in front):
        front = front[:k - 1]  # its slot: the best plan that can be exported without training for NE
        rest = [exact, *(t for t in rest if t is not exact)]
    for t in rest[:max(0, k - len(front))]:  # repeats of a plan are not measured trials: no plan comes twice
        front.append(FrontPoint(number=t.number, qps_gain=t.values[0], ne_gap=t.values[1],
                                gain_vs_eager=attr(t, "gain_vs_eager"), gain_vs_graph=attr(t, "gain_vs_graph"),
                                gain_detach_only=attr(t, "gain_detach_only"), plan=t.user_attrs[Attr.PLAN],
                                user_attrs=dict(t.user_attrs)))
    return front


def _dominates(a: list[float], b: list[float], band: float) -> bool:
    """``a`` (gain, NE gap) dominates ``b`` with NE gaps within ``band`` counted as equal."""
    no_worse = a[0] >= b[0] and a[1] <= b[1] + band
    better = a[0] > b[0] or a[1] < b[1] - band
    return no_worse and better


def load_study(db: Storage, study_name: str | None) -> optuna.Study:
    """An existing study in ``db`` (an opened storage); without a name, the only study there."""
    names = db.study_names()
    if study_name is None:
        if len(names) != 1:
            raise EraseTuneError(f"--study is needed: {db.url} holds {len(names)} studies ({', '.join(names) or 'none'})")
        study_name = names[0]
    if study_name not in names:
        raise EraseTuneError(f"no study named {shown(study_name)} in {db.url} (studies: {', '.join(names) or 'none'})")
    study = db.study(study_name)
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):  # a study made with Optuna itself
        got = ", ".join(d.name.lower() for d in study.directions)
        raise EraseTuneError(f"study {shown(study_name)} is not an erase-tune job: its objectives are ({got}), "
                             "not (maximize qps_gain, minimize ne_gap)")
    check_stored_attrs(study)
    return study


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "number": ("a number", _is_number),
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "text": ("text", lambda v: isinstance(v, str)),
    "flag": ("true or false", lambda v: isinstance(v, bool)),
    "mapping": ("a mapping", lambda v: isinstance(v, dict)),
    "workload": ("a mapping with a name", lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)
                 and isinstance(v.get("args", {}), dict)),
    "noise floor": ("a noise floor with a numeric band", lambda v: isinstance(v, dict) and _is_number(v.get("band"))
                    and all(_is_number(g) for g in v.get("gaps") or ()) and isinstance(v.get("kinds", []), list)),
    "baseline": ("eager or graph", lambda v: v in ("eager", "graph")),
}
_STUDY_ATTRS = {Attr.MAX_NE_GAP: "number", Attr.GAIN_OVER: "baseline", Attr.WORKLOAD: "workload",
                Attr.NOISE_FLOOR: "noise floor", Attr.NOISE_BAND: "number", Attr.STEP_COST: "mapping",
                Attr.REFERENCE_ERROR: "text", Attr.DRIVERS: "integer"}
_TRIAL_ATTRS = {Attr.PLAN: "mapping", Attr.PLAN_KEY: "text", Attr.PLAN_SUMMARY: "text", Attr.SEED_NAME: "text",
                Attr.DUPLICATE_OF: "integer", Attr.FAILURE_KIND: "text", Attr.FAILURE: "text", Attr.ATTEMPTS: "integer",
                Attr.DEVICE: "text", Attr.NODE: "text", Attr.DURATION: "number", Attr.MAX_NE_GAP: "number",
                Attr.FEASIBLE: "flag", Attr.EXACT: "flag", Attr.PHASE: "text", Attr.SCREEN_NAME: "text",
                **{k: "number" for k in ("gain_vs_eager", "gain_vs_graph", "gain_lo", "gain_hi", "windows", "gain_p90",
                                         "gain_median", "gain_detach_only", "exact_diff", "ne_baseline",
                                         "ne_candidate", "ne_gap")}}


def _trial_kind(key: str) -> str | None:
    if key in _TRIAL_ATTRS:
        return _TRIAL_ATTRS[key]
    return "number" if key.endswith("_qps") or key.startswith("ne_gap.") else None


def check_stored_attrs(study: optuna.Study) -> None:
    """Every attribute erase-tune reads back, of the kind it wrote (a value edited by hand, or
    written by another program, would end status, export or report in a traceback); None
    stands for a number that was not finite. Unknown keys are left alone."""
    name = shown(study.study_name)

    def check(where: str, key: str, value: Any, kind: str | None) -> None:
        if kind is None or value is None:
            return
        what, ok = _KINDS[kind]
        if not ok(value):
            raise EraseTuneError(f"study {name}: {where}stored attribute {shown(key)} is {shown(value)}, not {what} "
                                 "(damaged?); nothing was changed")

    for key, value in study.user_attrs.items():
        check("its ", key, value, _STUDY_ATTRS.get(key))
    for t in study.get_trials(deepcopy=False):
        for key, value in t.user_attrs.items():
            check(f"trial {t.number}'s ", key, value, _trial_kind(key))
