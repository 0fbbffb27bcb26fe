"""Reading a job back: its status and Pareto front, and exporting the plan production loads.

``export`` picks one trial from the Pareto front within an NE-gap budget — the largest
QPS gain (``max-gain``) or the knee of the front (``knee``: the point farthest from the
line joining the front's extremes, in normalised units) — and writes its plan as YAML
with provenance: study, trial, measured gains and NE gap, device and versions. The file is
written atomically, so a failed export never leaves a half-written plan behind.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import ErasePlan
from erase_tune.store import Store, default_storage_url, redact_url
from erase_tune.tune.study import Attr, FrontPoint, load_study, pareto_front

__all__ = ["JobStatus", "job_status", "export_plan", "PICKS", "pick_point"]

PICKS = ("max-gain", "knee")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobStatus:
    study_name: str
    storage: str
    job_status: str | None
    workload: dict[str, Any] | None
    max_ne_gap: float | None
    gain_over: str
    """The baseline ``qps_gain`` is measured against (eager or graph)."""
    counts: dict[str, int]
    front: list[FrontPoint]
    """Pareto front within the job's NE budget."""
    front_all: list[FrontPoint]
    """Pareto front ignoring the NE budget."""
    failures: list[tuple[int, str]]

    def table(self) -> str:
        c = self.counts
        lines = [
            f"study {self.study_name} in {self.storage}: job {self.job_status or 'unknown'}",
            f"trials: {c.get('COMPLETE', 0)} complete, {c.get('RUNNING', 0)} running, {c.get('FAIL', 0)} failed"
            + (f"; NE-gap budget {self.max_ne_gap:.2%}" if self.max_ne_gap is not None else ""),
        ]
        rows = self.front if self.front else self.front_all
        title = "Pareto front within the NE budget" if self.front else "Pareto front (no trial within the NE budget)"
        lines.append(title + ":")
        lines.append(f"  (QPS gain is p90 over the {self.gain_over} baseline; detach only = the same cuts without"
                     " early launch, over eager)")
        lines.append(f"  {'trial':>5} {'QPS gain':>9} {'NE gap':>8} {'vs eager':>9} {'vs graph':>9} {'detach only':>11}  plan")
        for p in rows:
            plan = ErasePlan.from_dict(p.plan).describe()
            lines.append(f"  {p.number:>5} {p.qps_gain:>+9.2%} {p.ne_gap:>+8.2%} {_pct(p.gain_vs_eager):>9} "
                         f"{_pct(p.gain_vs_reference):>9} {_pct(p.gain_detach_only):>11}  {plan}")
        if not rows:
            lines.append("  (no complete trials yet)")
        for number, reason in self.failures[-5:]:
            lines.append(f"  failed trial {number}: {reason}")
        return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def job_status(storage: str | None, study_name: str | None) -> JobStatus:
    url = storage or default_storage_url()
    study = load_study(url, study_name)
    max_gap = study.user_attrs.get(Attr.MAX_NE_GAP)
    counts: dict[str, int] = {}
    failures = []
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
        if t.state == TrialState.FAIL:
            failures.append((t.number, str(t.user_attrs.get(Attr.FAILURE, "unknown"))))
    store = Store(url)
    try:
        job = store.get_job(study.study_name)
    except EraseTuneError:
        job = None  # a bare Optuna study, or a database not migrated yet
    finally:
        store.close()
    return JobStatus(
        study_name=study.study_name, storage=redact_url(url), job_status=job.status if job else None,
        workload=study.user_attrs.get(Attr.WORKLOAD), max_ne_gap=max_gap,
        gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"), counts=counts,
        front=pareto_front(study, max_gap) if max_gap is not None else pareto_front(study),
        front_all=pareto_front(study), failures=failures,
    )


def pick_point(front: list[FrontPoint], pick: str) -> FrontPoint:
    """``max-gain``: the largest gain; ``knee``: farthest from the chord between the extremes."""
    if pick not in PICKS:
        raise EraseTuneError(f"--pick: {pick!r} is not one of {', '.join(PICKS)}")
    best = max(front, key=lambda p: (p.qps_gain, -p.ne_gap))
    if pick == "max-gain" or len(front) < 3:
        return best
    gains = [p.qps_gain for p in front]
    gaps = [p.ne_gap for p in front]
    g_span = (max(gains) - min(gains)) or 1.0
    n_span = (max(gaps) - min(gaps)) or 1.0
    pts = [((p.qps_gain - min(gains)) / g_span, (p.ne_gap - min(gaps)) / n_span) for p in front]
    a = min(range(len(front)), key=lambda i: pts[i][1])  # smallest gap end
    b = max(range(len(front)), key=lambda i: pts[i][0])  # largest gain end
    (x1, y1), (x2, y2) = pts[a], pts[b]
    norm = ((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5 or 1.0
    dist = [abs((y2 - y1) * x - (x2 - x1) * y + x2 * y1 - y2 * x1) / norm for x, y in pts]
    return front[max(range(len(front)), key=lambda i: (dist[i], front[i].qps_gain))]


def export_plan(storage: str | None, study_name: str, out: str | Path, *, max_ne_gap: float | None = None,
                pick: str = "max-gain") -> tuple[ErasePlan, FrontPoint]:
    """Write the chosen plan to ``out``; returns it and the trial it came from."""
    if pick not in PICKS:
        raise EraseTuneError(f"--pick: {pick!r} is not one of {', '.join(PICKS)}")
    url = storage or default_storage_url()
    study = load_study(url, study_name)
    budget = max_ne_gap if max_ne_gap is not None else study.user_attrs.get(Attr.MAX_NE_GAP)
    front = pareto_front(study, budget)
    if not front:
        complete = pareto_front(study)
        if not complete:
            raise EraseTuneError(f"study {study.study_name!r} has no complete trial to export")
        closest = min(p.ne_gap for p in complete)
        raise EraseTuneError(
            f"no trial of study {study.study_name!r} is within NE gap {budget:.2%} "
            f"(smallest gap on the front: {closest:.2%}); pass a larger --max-ne-gap"
        )
    point = pick_point(front, pick)
    attrs = point.user_attrs
    prov = attrs.get(Attr.PROVENANCE) or {}
    plan = dataclasses.replace(ErasePlan.from_dict(point.plan), provenance={
        "study": study.study_name,
        "trial": point.number,
        "storage": redact_url(url),
        "pick": pick,
        "max_ne_gap": budget,
        "qps_gain": point.qps_gain,
        "gain_over": study.user_attrs.get(Attr.GAIN_OVER, "eager"),
        "ne_gap": point.ne_gap,
        "gain_vs_eager_p90": point.gain_vs_eager,
        "gain_vs_graph_baseline": point.gain_vs_reference,
        "gain_detach_only": point.gain_detach_only,
        "workload": study.user_attrs.get(Attr.WORKLOAD),
        "device": attrs.get(Attr.DEVICE) or prov.get("device_name"),
        "torch": prov.get("torch"),
        "cuda": prov.get("cuda"),
        "measured_at": prov.get("date_utc"),
    })
    _write_atomic(Path(out), plan.dumps())
    store = Store(url)
    try:
        job = store.get_job(study.study_name)
        if job is not None:
            store.record_export(job, point.number, str(Path(out).resolve()), plan.dumps())
    finally:
        store.close()
    return plan, point


def _write_atomic(path: Path, text: str) -> None:
    parent = path.resolve().parent
    if not parent.is_dir():
        raise EraseTuneError(f"-o: directory {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
