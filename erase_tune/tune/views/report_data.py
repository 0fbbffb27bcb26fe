"""What ``erase-tune report`` reads from a study: one record per trial, the study's facts,
the front within the NE budget, and the parameters that decide the gain.

Trials are read in the current layout (flat scalar user attrs: ``gain_vs_eager``,
``gain_vs_graph``, ``gain_lo``, ...) and in the older one, which nested the numbers in a
``metrics`` user attr under partly different names (read through ``study.flat_attrs``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from erase_tune.errors import EraseTuneError, PlanError, shown
from erase_tune.tune.search.screen import FAILED, MEASURED, PHASES, RUNNING, phase_of, screen_line
from erase_tune.tune.search.study import flat_attrs, noise_band

__all__ = ["TrialRecord", "Importance", "StudyFacts", "read_records", "study_facts", "front_within_budget",
           "param_importance", "MIN_TRIALS_FOR_IMPORTANCE"]

MIN_TRIALS_FOR_IMPORTANCE = 10
"""Below this many measured plans the importance of a dozen parameters is noise, not a finding."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyFacts:
    """The job as a whole, for the page's first table."""

    study_name: str
    workload: dict[str, Any] | None
    max_ne_gap: float
    gain_over: str
    """The baseline ``qps_gain`` is measured against: eager or graph."""
    counts: dict[str, int]
    """Trials by Optuna state name."""
    measured: int
    """Complete trials with their own measurement."""
    feasible: int
    duplicates: int
    """Complete trials that repeat a measured plan (``duplicate_of``)."""
    noise_band: float = 0.0
    """The study's noise floor of the NE gap (erase_tune.measure.noise): gaps within budget + band are feasible."""
    noise_floor: dict[str, Any] | None = None
    """The whole noise-floor measurement (gaps, kinds, steps, provenance), if made."""
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    """Trials by phase (erase_tune.tune.search.screen.PHASES), in that order; waiting ones not counted."""
    screen: str | None = None
    """Where the structural screen stands, one line; None when no trial was the screen's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Importance:
    """Parameter importance for qps_gain; ``values`` is empty when it was not assessed."""

    values: dict[str, float]
    """Share of importance per parameter (sums to 1), largest first."""
    note: str
    """How it was assessed, or why not: one or two sentences for the page."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """What one trial measured, in the current attribute names (older studies are mapped)."""

    number: int
    state: str
    """Optuna's state name: COMPLETE, FAIL, RUNNING, ..."""
    qps_gain: float | None
    """The study's first objective: p90 QPS gain over the baseline the study's ``gain_over`` names."""
    ne_gap: float | None
    feasible: bool | None
    """NE gap within the study's budget (None without a measurement)."""
    gain_vs_eager: float | None = None
    gain_vs_graph: float | None = None
    gain_detach_only: float | None = None
    gain_median: float | None = None
    """Median-QPS gain over eager."""
    gain_lo: float | None = None
    """Lowest per-window median-QPS gain over eager (the timing windows interleave the two)."""
    gain_hi: float | None = None
    """Highest per-window median-QPS gain over eager."""
    plan_summary: str = "-"
    seed_name: str | None = None
    duplicate_of: int | None = None
    failure_kind: str | None = None
    failure_reason: str | None = None
    exact: bool = False
    """No cuts: exact by construction; its NE-gap objective is 0 and ``ne_gap_measured`` is noise."""
    ne_gap_measured: float | None = None
    phase: str = "search"
    """Which phase proposed it: seed, screen-single, screen-union or search."""
    screen_name: str | None = None
    """The structural screen's name of its plan (``graph top_l``), for the screen's trials."""

    @property
    def measured(self) -> bool:
        """A complete trial with its own measurement (a repeat of a measured plan is not)."""
        return (self.state == "COMPLETE" and self.qps_gain is not None and self.ne_gap is not None
                and self.duplicate_of is None)


# -- reading a study --------------------------------------------------------------------------


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _plan_summary(attrs: dict[str, Any]) -> str:
    if isinstance(attrs.get("plan_summary"), str):
        return attrs["plan_summary"]
    plan = attrs.get("plan")
    if plan is None:
        return "-"
    from erase_tune.runtime import ErasePlan

    try:
        return ErasePlan.from_dict(plan).describe()
    except PlanError as e:  # a plan written by another version: show it is unreadable, not crash
        return f"(unreadable plan: {e})"


def _record(trial: FrozenTrial, max_ne_gap: float, band: float = 0.0) -> TrialRecord:
    attrs = flat_attrs(trial.user_attrs)
    values = trial.values if trial.state == TrialState.COMPLETE and trial.values is not None else None
    gain = _number(values[0]) if values and len(values) == 2 else None
    gap = _number(values[1]) if values and len(values) == 2 else None
    dup = attrs.get("duplicate_of")
    exact = attrs.get("exact") is True
    return TrialRecord(
        number=trial.number, state=trial.state.name, qps_gain=gain, ne_gap=gap,
        # the same test the constraint makes (ne_gap - (max_ne_gap + band) <= 0), against the study's budget
        feasible=None if gap is None else exact or gap <= max_ne_gap + band,
        exact=exact, ne_gap_measured=_number(attrs.get("ne_gap")),
        gain_vs_eager=_number(attrs.get("gain_vs_eager")), gain_vs_graph=_number(attrs.get("gain_vs_graph")),
        gain_detach_only=_number(attrs.get("gain_detach_only")), gain_median=_number(attrs.get("gain_median")),
        gain_lo=_number(attrs.get("gain_lo")), gain_hi=_number(attrs.get("gain_hi")),
        plan_summary=_plan_summary(attrs),
        seed_name=attrs.get("seed_name") if isinstance(attrs.get("seed_name"), str) else None,
        duplicate_of=dup if isinstance(dup, int) and not isinstance(dup, bool) else None,
        failure_kind=str(attrs["failure_kind"]) if attrs.get("failure_kind") is not None else None,
        failure_reason=str(attrs["failure_reason"]) if attrs.get("failure_reason") is not None else None,
        phase=phase_of(attrs),
        screen_name=attrs.get("screen_name") if isinstance(attrs.get("screen_name"), str) else None,
    )


def _budget(study: optuna.Study) -> float:
    if [d for d in study.directions] != [StudyDirection.MAXIMIZE, StudyDirection.MINIMIZE]:
        got = ", ".join(d.name.lower() for d in study.directions)
        raise EraseTuneError(f"study {shown(study.study_name)} is not an erase-tune job: its objectives are ({got}), "
                             "not (maximize qps_gain, minimize ne_gap)")
    budget = _number(study.user_attrs.get("max_ne_gap"))
    if budget is None:
        raise EraseTuneError(f"study {shown(study.study_name)} has no NE budget (study attr max_ne_gap): "
                             "not an erase-tune job")
    return budget


def read_records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial of ``study`` as a ``TrialRecord``, by trial number."""
    budget, band = _budget(study), noise_band(study)
    return [_record(t, budget, band) for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)]


def study_facts(study: optuna.Study, records: Sequence[TrialRecord]) -> StudyFacts:
    counts: dict[str, int] = {}
    phases: dict[str, int] = {}
    for r in records:
        counts[r.state] = counts.get(r.state, 0) + 1
        if r.state != "WAITING":
            phases[r.phase] = phases.get(r.phase, 0) + 1
    states = {"COMPLETE": MEASURED, "RUNNING": RUNNING, "FAIL": FAILED}
    screened = [(r.phase, states.get(r.state, r.state) if r.duplicate_of is None else "repeat") for r in records]
    workload = study.user_attrs.get("workload")
    return StudyFacts(
        study_name=study.study_name, workload=workload if isinstance(workload, dict) else None,
        max_ne_gap=_budget(study), gain_over=str(study.user_attrs.get("gain_over", "eager")),
        counts=dict(sorted(counts.items())), measured=sum(r.measured for r in records),
        feasible=sum(r.measured and bool(r.feasible) for r in records),
        duplicates=sum(r.state == "COMPLETE" and r.duplicate_of is not None for r in records),
        noise_band=noise_band(study),
        noise_floor=study.user_attrs.get("noise_floor") if isinstance(study.user_attrs.get("noise_floor"), dict)
        else None,
        phases={p: phases[p] for p in PHASES if p in phases}, screen=screen_line(screened),
    )


def front_within_budget(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Measured trials within the NE budget that no other such trial dominates (at least the
    gain and at most the gap, not both equal), largest gain first; of trials with equal values,
    the earliest."""
    pool = [r for r in records if r.measured and r.feasible]
    front = [r for r in pool if not any(o.qps_gain >= r.qps_gain and o.ne_gap <= r.ne_gap
                                        and (o.qps_gain, o.ne_gap) != (r.qps_gain, r.ne_gap) for o in pool)]
    seen: set[tuple[float, float]] = set()
    out = []
    for r in sorted(front, key=lambda r: (-r.qps_gain, r.ne_gap, r.number)):
        if (r.qps_gain, r.ne_gap) not in seen:
            seen.add((r.qps_gain, r.ne_gap))
            out.append(r)
    return out


def param_importance(study: optuna.Study, records: Sequence[TrialRecord]) -> Importance:
    """Importance of each parameter for qps_gain over the measured plans, by Optuna's
    ``get_param_importances`` with PED-ANOVA (numpy only; no scikit-learn, unlike fANOVA and
    mean decrease impurity). Its conditional form weighs a parameter that exists only in some
    trials (a cut's stream exists only when the cut is on) over the trials where it is active."""
    measured_numbers = {r.number for r in records if r.measured}
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if t.number in measured_numbers]
    n = len(trials)
    if n < MIN_TRIALS_FOR_IMPORTANCE:
        return Importance(values={}, note=f"Parameter importance is not assessed: it needs at least "
                                          f"{MIN_TRIALS_FOR_IMPORTANCE} measured trials and this job has {n}.")
    if not any(t.distributions for t in trials):
        return Importance(values={}, note="Parameter importance is not assessed: the trials have no parameters.")
    # The top 10% of trials, but at least 5 of them: PED-ANOVA compares the parameters of the
    # best trials with all, and fewer than 5 "best" make that comparison noise.
    quantile = max(0.1, 5 / n)
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)
    # A repeat of a plan must not count twice: assess a copy holding the measured trials only.
    copy = optuna.create_study(directions=study.directions, storage=optuna.storages.InMemoryStorage())
    with warnings.catch_warnings():
        # Optuna warns about small regimes of conditional parameters and marks normalize=
        # experimental; the note on the page says what the numbers are worth.
        warnings.simplefilter("ignore")
        copy.add_trials(trials)
        try:
            raw = optuna.importance.get_param_importances(
                copy, evaluator=evaluator, target=lambda t: -t.values[0], normalize=False)  # lower is better
        except Exception as e:  # noqa: BLE001 - an optional figure must not take the whole report down
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return Importance(values={}, note=f"Parameter importance could not be assessed: {first}")
    total = sum(raw.values())
    if not total > 0:
        return Importance(values={}, note="Parameter importance is not assessed: no parameter separates the "
                                          "trials with the best QPS gain from the rest.")
    values = dict(sorted(((k, v / total) for k, v in raw.items()), key=lambda kv: (-kv[1], kv[0])))
    best = math.ceil(quantile * n)
    return Importance(values=values, note=(
        f"PED-ANOVA over {n} measured trials: how much each parameter's values among the {best} trials with "
        f"the highest qps_gain differ from its values over all of them; a parameter that exists only when "
        f"another is set (a cut's stream, its aux weight) is weighed where it is active."))
