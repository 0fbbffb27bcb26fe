"""The second look before a plan leaves the study: its speed, then its quality, re-measured.

At the end of ``start`` and in ``export``, the best front plans are re-timed against their
baseline by the same interleaved protocol as the trials (:mod:`erase_tune.measure.confirm`: one
process, windows added until each gain's 95% interval is within ±``CONFIRM_HALFWIDTH`` or a cap
is reached), and the plans whose gain is confirmed are trained again over several data
orders (:func:`erase_tune.measure.noise.confirm_quality`, an NE-gap interval). Both run on a trial
worker and are stored in the project's tables.

:func:`choose` is the one rule both ``start`` (to say what an export would write) and
``export`` apply: among front plans whose confirmed interval lies above 0 and whose NE holds
(:func:`quality_refused`), the best *lower bound* wins, so the plan exported is the one whose
gain is proven best, not the luckiest reading.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import optuna

from erase_tune.errors import EraseTuneError
from erase_tune.measure import quality
from erase_tune.measure.quality import QualityResult, quality_trainings
from erase_tune.runtime import ErasePlan
from erase_tune.store import Confirmation, ConfirmationRecord, QualityConfirmation, QualityRecord
from erase_tune.store.storage import Storage
from erase_tune.tune.execute.task import ConfirmSpec
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import Attr, FrontPoint, noise_band

log = logging.getLogger("erase_tune")

__all__ = ["MAX_CONFIRMED", "CONFIRM_HALFWIDTH", "MIN_CONFIRM_WINDOWS", "PICKS", "Choice",
           "choose", "pick_point", "confirm_front", "confirm_quality_front", "quality_refused", "with_quality"]

MAX_CONFIRMED = 3
"""Front plans re-measured at most (best search gains first): the top few, in one process."""
CONFIRM_HALFWIDTH = 0.02
"""A confirmation measures each plan until its gain's 95% interval is within ±2 points, or for
the space's ``budget.confirm_max_windows``."""
MIN_CONFIRM_WINDOWS = 2
"""Least windows a confirmation may be asked for (``--repeats``): an interval needs two
(:func:`erase_tune.measure.confirm.confirm_plans` refuses fewer, but only once the trials have run)."""
PICKS = ("max-gain", "knee")


def _confirmed(executor: Any, spec: ConfirmSpec, *, timeout: float, expected_s: float | None, what: str) -> Any:
    """Run ``spec`` on ``executor`` and return its result; a failed run raises
    :class:`EraseTuneError` naming ``what`` ("confirmation", "quality confirmation") and the reason."""
    outcome = executor.confirm(spec, timeout=timeout, expected_s=expected_s)
    if outcome.result is None:
        raise EraseTuneError(f"{what} of the front failed: {outcome.failure.reason}")
    return outcome.result


def confirm_front(db: Storage, study: optuna.Study, space: SearchSpace, executor: Any, front: list[FrontPoint], *,
                  windows: int, max_windows: int | None = None,
                  expected_s: float | None = None) -> dict[int, tuple[float, float, float]]:
    """Re-measure the best ``MAX_CONFIRMED`` front plans on ``executor`` (at least ``windows``
    windows, at most ``max_windows``, by default the space's ``budget.confirm_max_windows``; ``expected_s``: what that should take, when known) and
    store the results."""
    job = db.store.get_job(study.study_name)
    points = front[:MAX_CONFIRMED]
    wl = study.user_attrs[Attr.WORKLOAD]
    budget = dataclasses.asdict(space.budget.per_trial)
    spec = ConfirmSpec(workload=wl["name"], workload_args=wl["args"], plans={str(p.number): p.plan for p in points},
                       budget=budget, windows=windows, gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"),
                       max_windows=max(windows, space.budget.confirm_max_windows if max_windows is None else max_windows),
                       halfwidth=CONFIRM_HALFWIDTH)
    res = _confirmed(executor, spec, timeout=float(space.budget.timeout_s) * 2, expected_s=expected_s,
                     what="confirmation")
    out = {}
    for p in points:
        c = res.plans[str(p.number)]
        if job is not None:
            db.store.record_confirmation(job, p.number, ConfirmationRecord(
                plan_yaml=ErasePlan.from_dict(p.plan).dumps(), gain_over=res.gain_over, windows=res.windows,
                gain=c.gain, gain_lo=c.lo, gain_hi=c.hi,
                samples={k: v for k, v in res.samples.items() if k in ("baseline", str(p.number))},
                provenance={**res.provenance, "is_baseline": c.is_baseline}))
        out[p.number] = (c.gain, c.lo, c.hi)
    return out


def with_quality(space: SearchSpace, scale: int | None, seeds: int | None) -> SearchSpace:
    """``space`` with its budget's quality confirmation overridden (``--quality-scale``,
    ``--quality-seeds``; None keeps the space's)."""
    changes = {k: v for k, v in (("quality_scale", scale), ("quality_seeds", seeds)) if v is not None}
    return space.with_budget(**changes) if changes else space


def confirm_quality_front(db: Storage, study: optuna.Study, space: SearchSpace, executor: Any,
                          front: list[FrontPoint], expected_s: float | None = None) -> dict[int, QualityConfirmation]:
    """Train the first ``MAX_CONFIRMED`` of ``front`` (the plans that could be exported: their
    gain is confirmed) longer over several seeds (erase_tune.measure.noise.confirm_quality, the space's
    ``budget.quality_scale`` and ``quality_seeds``) and store the NE gaps with their intervals;
    nothing when the space turns quality confirmation off. Plans their trial verified exact are not trained."""
    budget = space.budget.per_trial
    if not budget.quality_scale or not front:
        return {}
    job = db.store.get_job(study.study_name)
    points = front[:MAX_CONFIRMED]
    wl = study.user_attrs[Attr.WORKLOAD]
    band = noise_band(study)
    floor = study.user_attrs.get(Attr.NOISE_FLOOR)
    exact = tuple(str(p.number) for p in points if p.user_attrs.get(Attr.EXACT))
    spec = ConfirmSpec(workload=wl["name"], workload_args=wl["args"], plans={str(p.number): p.plan for p in points},
                       budget=dataclasses.asdict(budget), windows=0,
                       gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"), task="quality", band=band,
                       exact=exact, floor=floor)
    runs = quality_trainings(len(points) - len(exact), budget, floor=floor is not None) * budget.quality_scale
    if runs:
        res = _confirmed(executor, spec, timeout=float(space.budget.timeout_s) * max(2, runs), expected_s=expected_s,
                         what="quality confirmation")
    else:  # every plan exact: nothing to train, so no worker is asked and nothing is waited for
        log.info("quality confirmation: the %d front plan(s) are exact (their trials checked the gradients equal to "
                 "the baseline's): nothing to train", len(points))
        res = QualityResult(steps=budget.quality_scale * budget.training_steps, seeds=(), ne_baseline=(),
                            plans={str(p.number): quality.QualityConfirmation.of_exact(band) for p in points},
                            provenance={"trained": False, "why": "every plan verified exact by its trial"})
    out = {}
    for p in points:
        c = res.plans[str(p.number)]
        if job is not None:
            out[p.number] = db.store.record_quality(job, p.number, QualityRecord(
                plan_yaml=ErasePlan.from_dict(p.plan).dumps(), steps=res.steps, seeds=len(res.seeds), ne_gap=c.ne_gap,
                ne_gap_lo=c.lo, ne_gap_hi=c.hi, per_seed=tuple(c.per_seed), exact=c.exact, band=band,
                provenance={**res.provenance, "ne_baseline": list(res.ne_baseline)}))
    return out


def quality_refused(q: QualityConfirmation | None, max_ne_gap: float, band: float) -> bool:
    """A plan with cuts is exported only when its confirmed NE-gap interval, widened by the noise
    floor on both sides, lies under the budget (``hi + band <= max_ne_gap``): the floor says how
    little the interval is worth, it never enlarges the budget. An exact plan is never refused."""
    return q is not None and not q.exact and q.ne_gap_hi + band > max_ne_gap


def pick_point(front: list[FrontPoint], pick: str, bounds: dict[int, float] | None = None) -> FrontPoint:
    """``max-gain``: the largest confirmed lower bound (``bounds``; the search gain where none is
    given); ``knee``: the front point farthest from the chord between its extremes, in
    normalised units."""
    if pick not in PICKS:
        raise EraseTuneError(f"--pick: {pick!r} is not one of {', '.join(PICKS)}")
    gain = (lambda p: bounds.get(p.number, p.qps_gain)) if bounds else (lambda p: p.qps_gain)  # noqa: E731
    best = max(front, key=lambda p: (gain(p), -p.ne_gap))
    if pick == "max-gain" or len(front) < 3:
        return best
    xs, ys = [gain(p) for p in front], [p.ne_gap for p in front]
    xspan, yspan = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    pts = [((x - min(xs)) / xspan, (y - min(ys)) / yspan) for x, y in zip(xs, ys)]
    a = min(range(len(front)), key=lambda i: pts[i][1])
    b = max(range(len(front)), key=lambda i: pts[i][0])
    (x1, y1), (x2, y2) = pts[a], pts[b]
    norm = ((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5 or 1.0
    dist = [abs((y2 - y1) * x - (x2 - x1) * y + x2 * y1 - y2 * x1) / norm for x, y in pts]
    return front[max(range(len(front)), key=lambda i: (dist[i], gain(front[i])))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """What an export writes, by :func:`choose`."""

    point: FrontPoint
    """The plan chosen; when ``refusal`` is set, the best plan that was refused."""
    confirmation: Confirmation | None
    quality: QualityConfirmation | None
    refusal: str | None = None
    """Why nothing may be exported (one line), or None."""
    quality_refusal: bool = False
    """The refusal is the NE gap's (the speed was confirmed)."""


def choose(front: list[FrontPoint], confirmed: dict[int, Confirmation], quality: dict[int, QualityConfirmation], *,
           max_ne_gap: float, band: float, pick: str = "max-gain", gain_over: str = "eager",
           quality_required: bool = False) -> Choice:
    """The export rule (module docstring): the plan ``pick`` chooses among front plans whose
    confirmed gain interval lies above 0 and whose NE holds, else a refusal naming the best.
    ``quality_required``: a plan with cuts whose NE gap was not confirmed is not chosen (the job
    confirms quality; one that had no time left for it exports only what needs none)."""
    confirmed = {n: c for n, c in confirmed.items() if any(p.number == n for p in front)}
    showing = [p for p in front if p.number in confirmed and confirmed[p.number].gain_lo > 0]
    # a plan the trial did not verify exact (cuts, or a gradient check that failed) needs its NE confirmed
    unjudged = [p for p in showing if quality_required and not p.user_attrs.get(Attr.EXACT)
                and p.number not in quality]
    too_costly = [p for p in showing if quality_refused(quality.get(p.number), max_ne_gap, band)]
    showing = [p for p in showing if p not in too_costly and p not in unjudged]
    if showing:
        point = pick_point(showing, pick, {n: c.gain_lo for n, c in confirmed.items()})
        return Choice(point=point, confirmation=confirmed[point.number], quality=quality.get(point.number))
    if unjudged and not too_costly:
        p = unjudged[0]
        return Choice(point=p, confirmation=confirmed[p.number], quality=None, quality_refusal=True, refusal=(
            f"the best confirmed plan, trial {p.number}, is not exact (it has cuts, or its gradients differ from the "
            "baseline's) and its NE gap was not confirmed (the job's time budget left it out): pass --quality-scale N "
            "to export to confirm it now"))
    if too_costly:
        p = too_costly[0]
        q = quality[p.number]
        return Choice(point=p, confirmation=confirmed[p.number], quality=q, quality_refusal=True, refusal=(
            f"no plan on the front keeps its NE gap on other data orders: the best, trial {p.number}, confirmed at NE "
            f"gap {q.ne_gap:+.2%} [{q.ne_gap_lo:+.2%}, {q.ne_gap_hi:+.2%}] over {q.seeds} seeds of {q.steps} steps; "
            f"with the noise floor (±{band:.2%}) its interval reaches above the budget {max_ne_gap:.2%}"))
    best = max(front, key=lambda p: confirmed[p.number].gain_lo if p.number in confirmed else p.qps_gain)
    c = confirmed.get(best.number)
    seen = f"{c.gain:+.2%} [{c.gain_lo:+.2%}, {c.gain_hi:+.2%}] over {c.windows} windows" if c else "unconfirmed"
    if c is not None and c.provenance.get("is_baseline"):
        seen = "+0% (it is the baseline itself: no cuts, no placements)"
    return Choice(point=best, confirmation=c, quality=quality.get(best.number), refusal=(
        f"no plan on the front shows a gain once re-measured: the best, trial {best.number}, confirmed at {seen} "
        f"over the {gain_over} baseline"))
