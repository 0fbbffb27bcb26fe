"""``erase-tune status``: a job, its trials by phase and where its structural screen stands,
its noise floor, Pareto front, confirmations (of speed and of quality) and exports; or one trial.

Everything shown is read from where it is stored once: the trials and their metrics from
the Optuna study, the job, confirmations, exports and a trial's raw samples, traceback and
provenance from erase-tune's tables. Without ``--study`` on a storage that holds several
jobs, the jobs are listed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optuna.trial import TrialState

from erase_tune.errors import EraseTuneError, shown
from erase_tune.store import Confirmation, Export, Job, QualityConfirmation, StoredOutcome, default_storage_url
from erase_tune.store.storage import Storage, open_storage
from erase_tune.tune.search.screen import FAILED, MEASURED, PHASES, RUNNING, phase_of, screen_line
from erase_tune.tune.search.study import load_study
from erase_tune.tune.search.study import Attr, FrontPoint, pareto_front

__all__ = ["JobStatus", "TrialDetail", "job_status", "trial_detail", "list_jobs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobStatus:
    study_name: str
    storage: str
    job: Job | None
    workload: dict[str, Any] | None
    max_ne_gap: float | None
    gain_over: str
    counts: dict[str, int]
    """Trials by state; ``REPEAT`` counts proposals answered from an earlier trial."""
    front: list[FrontPoint]
    front_all: list[FrontPoint]
    failures: list[tuple[int, str, str]]
    """(trial, kind, reason) of failed trials."""
    confirmations: list[Confirmation]
    exports: list[Export]
    noise_floor: dict[str, Any] | None = None
    """The study's noise floor of the NE gap (erase_tune.measure.noise), if measured."""
    quality: list[QualityConfirmation] = dataclasses.field(default_factory=list)
    """Quality confirmations (front plans trained again over other data orders), oldest first."""
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    """Trials by phase (erase_tune.tune.search.screen.PHASES), in that order; waiting ones not counted."""
    screen: str | None = None
    """Where the structural screen stands, one line; None when no trial was the screen's."""

    def table(self) -> str:
        c = self.counts
        lines = [f"study {self.study_name} in {self.storage}: job {self.job.status if self.job else 'unknown'}",
                 f"trials: {c.get('COMPLETE', 0)} measured, {c.get('RUNNING', 0)} running, {c.get('FAIL', 0)} failed, "
                 f"{c.get('REPEAT', 0)} repeats" + (f"; NE-gap budget {self.max_ne_gap:.2%}" if self.max_ne_gap
                                                     is not None else "")]
        if self.phases:
            lines.append("phases: " + ", ".join(f"{n} {phase}" for phase, n in self.phases.items()))
        if self.screen:
            lines.append(self.screen)
        band = 0.0
        if self.noise_floor:
            band = float(self.noise_floor["band"])
            gaps = ", ".join(f"{k} {g:+.2%}" for k, g in zip(self.noise_floor.get("kinds", []),
                                                            self.noise_floor.get("gaps", [])))
            lines.append(f"noise floor of the NE gap: ±{band:.2%} (baseline against itself, "
                         f"{self.noise_floor.get('training_steps')} steps: {gaps}); infeasible only above "
                         f"{(self.max_ne_gap or 0.0) + band:.2%}" if self.max_ne_gap is not None else
                         f"noise floor of the NE gap: ±{band:.2%} ({gaps})")
        else:
            lines.append("noise floor of the NE gap: not measured")
        rows = self.front or self.front_all
        lines.append(("Pareto front within the NE budget" if self.front else
                      "Pareto front (no trial within the NE budget)") + ":")
        lines.append(f"  (QPS gain over the {self.gain_over} baseline: the mean of per-window gains, with its 95%"
                     " interval and the windows it took; detach only = the same cuts without early launch, over"
                     " eager)")
        lines.append("  (NE gap 'exact': the plan's gradients were checked equal to the baseline's; never trained for NE)")
        lines.append(f"  {'trial':>5} {'QPS gain':>9} {'interval (windows)':>24} {'NE gap':>9} {'vs eager':>9} "
                     f"{'vs graph':>9} {'detach only':>11} {'confirmed':>24} {'confirmed NE gap':>24}  {'phase':<13} "
                     "plan")
        confirmed = {x.trial_number: x for x in self.confirmations}
        quality = {x.trial_number: x for x in self.quality}
        for p in rows:
            conf = confirmed.get(p.number)
            shown = f"{conf.gain:+.2%} [{conf.gain_lo:+.1%},{conf.gain_hi:+.1%}]" if conf else "-"
            q = quality.get(p.number)
            qshown = "-" if q is None else "exact" if q.exact else \
                f"{q.ne_gap:+.2%} [{q.ne_gap_lo:+.1%},{q.ne_gap_hi:+.1%}]"
            gap = "exact" if p.user_attrs.get(Attr.EXACT) else f"{p.ne_gap:+.2%}"
            lo, hi, windows = (p.user_attrs.get(k) for k in ("gain_lo", "gain_hi", "windows"))
            interval = f"[{lo:+.1%},{hi:+.1%}] ({windows:.0f})" if isinstance(lo, float) and isinstance(hi, float) \
                and isinstance(windows, (int, float)) else "-"
            lines.append(f"  {p.number:>5} {p.qps_gain:>+9.2%} {interval:>24} {gap:>9} {_pct(p.gain_vs_eager):>9} "
                         f"{_pct(p.gain_vs_graph):>9} {_pct(p.gain_detach_only):>11} {shown:>24} {qshown:>24}  "
                         f"{phase_of(p.user_attrs):<13} {p.user_attrs.get(Attr.PLAN_SUMMARY, '')}")
            by_task = _task_gaps(p.user_attrs)
            if by_task:
                lines.append(f"  {'':>5} NE gap by task: {by_task}")
        if not rows:
            lines.append("  (no measured trials yet)")
        for number, kind, reason in self.failures[-5:]:
            lines.append(f"  failed trial {number} ({kind}): {reason}")
        for e in self.exports[-3:]:
            lines.append(f"  exported trial {e.trial_number} to {e.path} at {e.created_at:%Y-%m-%d %H:%M} UTC")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialDetail:
    number: int
    state: str
    values: list[float] | None
    attrs: dict[str, Any]
    outcome: StoredOutcome | None

    def table(self) -> str:
        lines = [f"trial {self.number}: {self.state}" + (f", QPS gain {self.values[0]:+.2%}, NE gap "
                                                         f"{self.values[1]:+.2%}" if self.values else "")]
        for key in sorted(self.attrs):
            if key not in (Attr.PLAN, Attr.PLAN_KEY):
                lines.append(f"  {key}: {self.attrs[key]}")
        o = self.outcome
        if o is None:
            lines.append("  (no stored outcome: running, a repeat, or its driver stopped)")
            return "\n".join(lines)
        lines.append(f"  attempts: {o.attempts}; node: {o.node}")
        for variant, s in o.samples.items():
            steps = [x for x in s.get("steps_s", []) if x]
            if steps:
                lines.append(f"  samples {variant}: {len(steps)} steps, {min(steps) * 1e3:.2f}-{max(steps) * 1e3:.2f} ms"
                             f" per step, windows {sorted(set(s.get('window') or []))}")
        for key in ("device_name", "torch", "cuda", "hostname", "date_utc", "training_steps"):
            if key in o.provenance:
                lines.append(f"  {key}: {o.provenance[key]}")
        if o.traceback:
            lines.append("  traceback:")
            lines.extend("    " + line for line in o.traceback.rstrip().splitlines())
        return "\n".join(lines)


_STATES = {"COMPLETE": MEASURED, "RUNNING": RUNNING, "FAIL": FAILED}
"""Optuna's states as the screen's line counts them (a repeat is none of these)."""


def _task_gaps(attrs: dict[str, Any]) -> str:
    """A multi-task trial's NE gap per task (its ``ne_gap.<task>`` attributes), or ''."""
    gaps = {k.split(".", 1)[1]: v for k, v in sorted(attrs.items()) if k.startswith("ne_gap.")}
    if not gaps:
        return ""
    exact = bool(attrs.get(Attr.EXACT))
    return ", ".join(f"{task} {'exact' if exact else '-' if not isinstance(g, (int, float)) else format(g, '+.2%')}"
                     for task, g in gaps.items())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def job_status(storage: str | None, study_name: str | None) -> JobStatus:
    db = open_storage(storage if storage is not None else default_storage_url(), must_exist=True, upgrade=False)
    try:
        study = load_study(db, study_name)
        budget = study.user_attrs.get(Attr.MAX_NE_GAP)
        counts: dict[str, int] = {}
        phases: dict[str, int] = {}
        screened: list[tuple[str, str]] = []  # (phase, state) of each trial with its own plan
        failures = []
        for t in study.get_trials(deepcopy=False):
            state = "REPEAT" if Attr.DUPLICATE_OF in t.user_attrs else t.state.name
            counts[state] = counts.get(state, 0) + 1
            if t.state != TrialState.WAITING:
                phase = phase_of(t.user_attrs)
                phases[phase] = phases.get(phase, 0) + 1
                screened.append((phase, _STATES.get(state, state)))
            if t.state == TrialState.FAIL and state != "REPEAT":
                failures.append((t.number, str(t.user_attrs.get(Attr.FAILURE_KIND, "stale")),
                                 str(t.user_attrs.get(Attr.FAILURE, "its driver stopped (no heartbeat)"))))
        job = _job(db, study.study_name)
        return JobStatus(
            study_name=study.study_name, storage=db.url, job=job, workload=study.user_attrs.get(Attr.WORKLOAD),
            max_ne_gap=budget, gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"), counts=counts,
            front=pareto_front(study, budget) if budget is not None else pareto_front(study),
            front_all=pareto_front(study), failures=failures,
            confirmations=db.store.confirmations(job) if job else [], exports=db.store.exports(job) if job else [],
            noise_floor=study.user_attrs.get(Attr.NOISE_FLOOR),
            quality=db.store.quality_confirmations(job) if job else [],
            phases={p: phases[p] for p in PHASES if p in phases}, screen=screen_line(screened))
    finally:
        db.close()


def trial_detail(storage: str | None, study_name: str | None, number: int) -> TrialDetail:
    db = open_storage(storage if storage is not None else default_storage_url(), must_exist=True, upgrade=False)
    try:
        study = load_study(db, study_name)
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        if number not in trials:
            raise EraseTuneError(f"--trial: study {shown(study.study_name)} has no trial {number} "
                                 f"(trials 0..{max(trials, default=-1)})")
        t = trials[number]
        job = _job(db, study.study_name)
        return TrialDetail(number=number, state=t.state.name, values=t.values, attrs=dict(t.user_attrs),
                           outcome=db.store.outcome(job, number) if job else None)
    finally:
        db.close()


def list_jobs(storage: str | None) -> list[Job]:
    db = open_storage(storage if storage is not None else default_storage_url(), must_exist=True, upgrade=False)
    try:
        return db.store.list_jobs()
    finally:
        db.close()


def _job(db: Storage, name: str) -> Job | None:
    try:
        return db.store.get_job(name)
    except EraseTuneError:  # a bare Optuna study, or a database erase-tune never migrated
        return None
