"""The second look before a plan leaves the study: its speed, then its quality, re-measured.

At the end of ``start`` and in ``export``, the best front plans are re-timed against their
baseline (:mod:`erase_tune.confirm`: interleaved in one process, a 95% interval per gain), and
the plans whose gain is confirmed are trained longer over several data orders
(:func:`erase_tune.noise.confirm_quality`, an NE-gap interval). Both run on a trial worker
and are stored in the project's tables; :func:`quality_refused` is the rule ``export`` applies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optuna

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import ErasePlan
from erase_tune.store import QualityConfirmation
from erase_tune.store.storage import Storage
from erase_tune.tune.execute.task import ConfirmSpec
from erase_tune.tune.search.study import Attr, FrontPoint, noise_band

__all__ = ["MAX_CONFIRMED", "confirm_front", "confirm_quality_front", "quality_refused", "with_quality"]

MAX_CONFIRMED = 5
"""Front plans re-measured at most (best search gains first): one process holds them all."""


def confirm_front(db: Storage, study: optuna.Study, space_like: Any, executor: Any, front: list[FrontPoint], *,
                  windows: int) -> dict[int, tuple[float, float, float]]:
    """Re-measure the best ``MAX_CONFIRMED`` front plans on ``executor`` and store the results."""
    job = db.store.get_job(study.study_name)
    points = front[:MAX_CONFIRMED]
    wl = study.user_attrs[Attr.WORKLOAD]
    budget = dataclasses.asdict(space_like.budget)
    spec = ConfirmSpec(workload=wl["name"], workload_args=wl["args"], plans={str(p.number): p.plan for p in points},
                       budget=budget, windows=windows, gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"))
    outcome = executor.confirm(spec, timeout=float(space_like.timeout_s) * 2)
    if outcome.result is None:
        raise EraseTuneError(f"confirmation of the front failed: {outcome.failure.reason}")
    res = outcome.result
    out = {}
    for p in points:
        c = res.plans[str(p.number)]
        if job is not None:
            db.store.record_confirmation(job, p.number, plan_yaml=ErasePlan.from_dict(p.plan).dumps(),
                                         gain_over=res.gain_over, windows=res.windows, gain=c.gain, gain_lo=c.lo,
                                         gain_hi=c.hi, samples={k: v for k, v in res.samples.items()
                                                                if k in ("baseline", str(p.number))},
                                         provenance={**res.provenance, "is_baseline": c.is_baseline})
        out[p.number] = (c.gain, c.lo, c.hi)
    return out


def with_quality(space: Any, scale: int | None, seeds: int | None) -> Any:
    """``space`` with its budget's quality confirmation overridden (``--quality-scale``,
    ``--quality-seeds``; None keeps the space's)."""
    changes = {k: v for k, v in (("quality_scale", scale), ("quality_seeds", seeds)) if v is not None}
    if not changes:
        return space
    return dataclasses.replace(space, budget=dataclasses.replace(space.budget, **changes))


def confirm_quality_front(db: Storage, study: optuna.Study, space_like: Any, executor: Any,
                          front: list[FrontPoint]) -> dict[int, QualityConfirmation]:
    """Train the first ``MAX_CONFIRMED`` of ``front`` (the plans that could be exported: their
    gain is confirmed) longer over several seeds (erase_tune.noise.confirm_quality, the space's
    ``budget.quality_scale`` and ``quality_seeds``) and store the NE gaps with their intervals;
    nothing when the space turns quality confirmation off. Plans with no cuts are not trained."""
    budget = space_like.budget
    if not getattr(budget, "quality_scale", 0) or not front:
        return {}
    job = db.store.get_job(study.study_name)
    points = front[:MAX_CONFIRMED]
    wl = study.user_attrs[Attr.WORKLOAD]
    band = noise_band(study)
    spec = ConfirmSpec(workload=wl["name"], workload_args=wl["args"], plans={str(p.number): p.plan for p in points},
                       budget=dataclasses.asdict(budget), windows=0,
                       gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"), task="quality", band=band)
    runs = (len(points) + 1) * budget.quality_seeds * budget.quality_scale
    outcome = executor.confirm(spec, timeout=float(space_like.timeout_s) * max(2, runs))
    if outcome.result is None:
        raise EraseTuneError(f"quality confirmation of the front failed: {outcome.failure.reason}")
    res = outcome.result
    out = {}
    for p in points:
        c = res.plans[str(p.number)]
        if job is not None:
            out[p.number] = db.store.record_quality(
                job, p.number, plan_yaml=ErasePlan.from_dict(p.plan).dumps(), steps=res.steps,
                seeds=len(res.seeds), ne_gap=c.ne_gap, ne_gap_lo=c.lo, ne_gap_hi=c.hi, per_seed=c.per_seed,
                exact=c.exact, band=band, provenance={**res.provenance, "ne_baseline": list(res.ne_baseline)})
    return out


def quality_refused(q: QualityConfirmation | None, max_ne_gap: float, band: float) -> bool:
    """A confirmed NE gap above the budget beyond the noise: the plan is not exported."""
    return q is not None and not q.exact and q.ne_gap > max_ne_gap + band
