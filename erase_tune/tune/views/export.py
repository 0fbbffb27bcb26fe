"""``erase-tune export``: confirm the front, then write the plan production training loads.

The front within the NE budget is re-measured first (:mod:`erase_tune.measure.confirm`: baseline
and front plans interleaved in one process, ``windows`` more windows) unless the job's own
end-of-run confirmation already did so with at least as many windows. ``export`` then applies
the rule ``start`` applied at its end (:func:`erase_tune.tune.run.confirm.choose`, so the two
agree): among the plans whose confirmed gain interval lies above 0, the largest confirmed lower
bound (``max-gain``) or the knee of the front (``knee``), written atomically with both the search
measurement and the confirmation in its provenance. If no plan shows a gain, it says so and
exits non-zero (``--force`` writes the best one anyway, marked unconfirmed).

Quality is confirmed too (where the space's ``budget.quality_scale`` is not 0): the same front
plans are trained ``quality_scale`` times longer over ``quality_seeds`` seeds against the
baseline trained the same way (erase_tune.measure.noise.confirm_quality). A plan with cuts is exported
only when its confirmed NE-gap interval, widened by the study's noise floor, lies under the
budget (same rule and ``--force``); an exact plan (no cuts, gradients checked) is not trained;
the file records the search NE gap, the noise floor and the confirmed NE gap with its interval.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import optuna

from erase_tune._files import check_output, write_atomic
from erase_tune.errors import EraseTuneError, one_line, shown
from erase_tune.runtime import ErasePlan
from erase_tune.store import Confirmation, QualityConfirmation, default_storage_url
from erase_tune.store.storage import Storage, StorageLost, open_storage
from erase_tune.store.engine import storage_files
from erase_tune.tune.search.space import MAX_NE_GAP, SearchSpace
from erase_tune.measure.records import MAX_CONFIRM_WINDOWS
from erase_tune.tune.run.confirm import (
    MAX_CONFIRMED,
    MIN_CONFIRM_WINDOWS,
    PICKS,
    choose,
    confirm_front,
    confirm_quality_front,
    pick_point,
    quality_refused,
    with_quality,
)
from erase_tune.tune.search.study import Attr, FrontPoint, finalists, load_study, noise_band, pareto_front

__all__ = ["PICKS", "ConfirmSettings", "NoConfirmedGain", "Exported", "export_plan", "pick_point"]



class NoConfirmedGain(EraseTuneError):
    """No front plan's confirmed gain interval lies above 0."""

    exit_code = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exported:
    plan: ErasePlan
    point: FrontPoint
    confirmation: Confirmation | None
    confirmations: dict[int, Confirmation]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmSettings:
    """How export confirms the front (``--repeats``, ``--quality-scale``, ``--quality-seeds``):
    ``windows`` more timing windows per plan, and quality trained ``quality_scale`` times longer
    over ``quality_seeds`` seeds (None: the space's own)."""

    windows: int = 5
    quality_scale: int | None = None
    quality_seeds: int | None = None


def export_plan(storage: str | None, study_name: str, out: str | Path, *, max_ne_gap: float | None = None,
                pick: str = "max-gain", force: bool = False, executor_factory: Any = None,
                confirm: ConfirmSettings = ConfirmSettings()) -> Exported:
    """Confirm the front (where not yet confirmed) and write the chosen plan to ``out``."""
    windows = confirm.windows
    _check_arguments(pick, windows, max_ne_gap)
    target = _check_output(out, storage)  # as typed: Path() would drop a trailing slash
    db = open_storage(storage if storage is not None else default_storage_url(), must_exist=True)
    try:
        study = load_study(db, study_name)
        budget = max_ne_gap if max_ne_gap is not None else study.user_attrs.get(Attr.MAX_NE_GAP)
        front = _front_within(study, budget)
        job = db.store.get_job(study.study_name)
        done = _latest(db.store.confirmations(job) if job else [], windows)
        if any(p.number not in done for p in front[:MAX_CONFIRMED]):
            if executor_factory is None:
                raise EraseTuneError("the front is not confirmed yet and no executor was given to confirm it")
            with executor_factory(job) as (executor, job_space):
                confirm_front(db, study, job_space, executor, front, windows=windows)
            done = _latest(db.store.confirmations(job), windows)
        confirmed = {n: c for n, c in done.items() if any(p.number == n for p in front)}
        showing = [p for p in front if p.number in confirmed and confirmed[p.number].gain_lo > 0]
        space, quality = _confirmed_quality(db, study, job, showing, executor_factory, confirm)
        band = noise_band(study)
        choice = choose(front, confirmed, quality, max_ne_gap=budget, band=band, pick=pick,
                        gain_over=study.user_attrs.get(Attr.GAIN_OVER, "eager"),
                        quality_required=bool(space is not None and space.budget.per_trial.quality_scale))
        if choice.refusal is not None and not force:
            raise NoConfirmedGain(f"{choice.refusal}; nothing written (--force writes it anyway, marked unconfirmed)")
        point = choice.point
        conf = confirmed.get(point.number)
        prov = _provenance(study, db, point, pick, budget, conf)
        prov.update(_quality_provenance(study, quality.get(point.number), budget, band))
        if point.user_attrs.get(Attr.EXACT):  # gradients checked equal to the baseline's: NE gap 0 by construction
            prov["exact"] = True
        plan = dataclasses.replace(ErasePlan.from_dict(point.plan), provenance=prov)
        _write_atomic(target, plan.dumps(), storage)
        if job is not None:
            try:
                db.store.record_export(job, point.number, str(target.resolve()), plan.dumps())
            except StorageLost as e:  # the plan is written: the one line must not read as if nothing were
                raise StorageLost(f"wrote {one_line(str(target), 300)}, but did not record the export: {e}") from None
        return Exported(plan=plan, point=point, confirmation=conf, confirmations=confirmed)
    finally:
        db.close()


def _check_arguments(pick: str, windows: int, max_ne_gap: float | None) -> None:
    """Refuse a ``--pick``, ``--repeats`` or ``--max-ne-gap`` export cannot use, before anything is opened."""
    if pick not in PICKS:
        raise EraseTuneError(f"--pick: {pick!r} is not one of {', '.join(PICKS)}")
    if isinstance(windows, bool) or not isinstance(windows, int) or not MIN_CONFIRM_WINDOWS <= windows \
            <= MAX_CONFIRM_WINDOWS:
        raise EraseTuneError(f"--repeats: {shown(windows)} must be an integer in {MIN_CONFIRM_WINDOWS}.."
                             f"{MAX_CONFIRM_WINDOWS} (an interval needs two windows)")
    if max_ne_gap is not None and (isinstance(max_ne_gap, bool) or not isinstance(max_ne_gap, (int, float))
                                   or not 0 <= max_ne_gap <= MAX_NE_GAP):  # also refuses nan
        raise EraseTuneError(f"--max-ne-gap: {shown(max_ne_gap)} must be between 0 and {MAX_NE_GAP:g} (as a space "
                             "file's max_ne_gap)")


def _front_within(study: optuna.Study, budget: float | None) -> list[FrontPoint]:
    """The finalists of the front within the NE budget; refused, saying why, when there are none."""
    front = finalists(study, budget, MAX_CONFIRMED)
    if not front:
        every = pareto_front(study)
        if not every:
            raise EraseTuneError(f"study {shown(study.study_name)} has no complete trial to export")
        raise EraseTuneError(f"no trial of study {shown(study.study_name)} is within NE gap {budget:.2%} (smallest gap "
                             f"on the front: {min(p.ne_gap for p in every):.2%}); pass a larger --max-ne-gap")
    return front


def _confirmed_quality(db: Storage, study: optuna.Study, job: Any, showing: list[FrontPoint], executor_factory: Any,
                       confirm: ConfirmSettings) -> tuple[SearchSpace | None, dict[int, QualityConfirmation]]:
    """The job's space (with ``confirm``'s quality scale and seeds) and the newest quality
    confirmation of each trial, after confirming the quality of the plans in ``showing`` that
    have none yet (where the space asks for it)."""
    quality = _latest_quality(db.store.quality_confirmations(job)) if job else {}
    space = _stored_space(job)
    space = None if space is None else with_quality(space, confirm.quality_scale, confirm.quality_seeds)
    missing = [p for p in showing if p.number not in quality]
    # A job whose time budget left the quality confirmation out chose without it: export agrees
    # with it unless asked to confirm quality now (--quality-scale).
    left_out = bool(study.user_attrs.get(Attr.QUALITY_LEFT_OUT)) and confirm.quality_scale is None
    if space is not None and space.budget.per_trial.quality_scale and missing and not left_out:
        if executor_factory is None:
            raise EraseTuneError("the front's quality is not confirmed yet and no executor was given to confirm it")
        with executor_factory(job) as (executor, job_space):
            confirm_quality_front(db, study, with_quality(job_space, confirm.quality_scale, confirm.quality_seeds),
                                  executor, missing)
        quality = _latest_quality(db.store.quality_confirmations(job))
    return space, quality


def _latest(confirmations: list[Confirmation], windows: int) -> dict[int, Confirmation]:
    """The newest confirmation of each trial made with at least ``windows`` windows."""
    out: dict[int, Confirmation] = {}
    for c in confirmations:
        if c.windows >= windows:
            out[c.trial_number] = c
    return out


def _latest_quality(rows: list[QualityConfirmation]) -> dict[int, QualityConfirmation]:
    """The newest quality confirmation of each trial."""
    return {q.trial_number: q for q in rows}


def _stored_space(job: Any) -> SearchSpace | None:
    """The job's space as it was stored (its budget says whether quality is confirmed)."""
    if job is None:
        return None
    try:
        return SearchSpace.loads(job.space_yaml, source=job.space_path, base=Path(job.space_path).parent)
    except EraseTuneError:  # a space this erase-tune no longer reads: nothing to confirm by
        return None


def _quality_provenance(study: optuna.Study, q: QualityConfirmation | None, budget: float,
                        band: float) -> dict[str, Any]:
    """What the exported file records of quality: the noise floor and the confirmed NE gap."""
    out: dict[str, Any] = {"ne_noise_band": band}
    floor = study.user_attrs.get(Attr.NOISE_FLOOR)
    if isinstance(floor, dict):
        out["ne_noise_steps"] = floor.get("training_steps")
        out["ne_noise_kinds"] = ",".join(floor.get("kinds") or [])
    if q is not None:
        out.update({"confirmed_ne_gap": q.ne_gap, "confirmed_ne_gap_lo": q.ne_gap_lo,
                    "confirmed_ne_gap_hi": q.ne_gap_hi, "confirmed_ne_seeds": q.seeds,
                    "confirmed_ne_steps": q.steps, "exact": q.exact,
                    "quality_confirmed": not quality_refused(q, budget, band)})
    else:
        out["quality_confirmed"] = False
    return out


def _provenance(study: optuna.Study, db: Storage, point: FrontPoint, pick: str, budget: float,
                conf: Confirmation | None) -> dict[str, Any]:
    attrs = point.user_attrs
    wl = study.user_attrs.get(Attr.WORKLOAD) or {}
    out: dict[str, Any] = {
        "study": study.study_name, "trial": point.number, "storage": db.url, "pick": pick, "max_ne_gap": budget,
        "gain_over": study.user_attrs.get(Attr.GAIN_OVER, "eager"), "workload": wl.get("name"),
        "workload_args": {k: v for k, v in (wl.get("args") or {}).items() if isinstance(v, (str, int, float, bool))},
        "search_qps_gain": point.qps_gain, "search_ne_gap": point.ne_gap, "search_gain_vs_eager": point.gain_vs_eager,
        "search_gain_vs_graph": point.gain_vs_graph, "search_gain_detach_only": point.gain_detach_only,
        "device": attrs.get(Attr.DEVICE), "confirmed": conf is not None and conf.gain_lo > 0,
    }
    if conf is not None:
        out.update({"confirmed_gain": conf.gain, "confirmed_gain_lo": conf.gain_lo, "confirmed_gain_hi": conf.gain_hi,
                    "confirmed_windows": conf.windows, "confirmed_at": conf.created_at.isoformat(),
                    "torch": conf.provenance.get("torch"), "cuda": conf.provenance.get("cuda")})
    return out


def _check_output(path: str | Path, storage: str | None = None) -> Path:
    """The plan file's path, checked before the storage is even opened (see :func:`check_output`)."""
    target = check_output(path, flag="-o", protect=storage_files(storage))
    parent = Path(os.path.realpath(target)).parent
    if not os.access(parent, os.W_OK):
        raise EraseTuneError(f"-o: directory {one_line(str(parent), 300)} is not writable")
    return target


def _write_atomic(path: Path, text: str, storage: str | None = None) -> None:
    # checked again: the confirmation before this can take minutes
    write_atomic(path, text, flag="-o", protect=storage_files(storage))
