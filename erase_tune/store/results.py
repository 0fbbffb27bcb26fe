"""The measurement half of :class:`~erase_tune.store.Store`: trial outcomes, confirmations,
the baseline cache and exports (the job half and the schema are in :mod:`erase_tune.store.repo`).

Every method is retried while the storage is away (:func:`erase_tune.store.retry.retried`).
Writes that a retry may repeat (an outcome replayed from the journal, a baseline measured
again) are single-statement upserts, so they never duplicate a row or race into an
integrity error; the records kept as a history (confirmations, noise floors, exports) are
plain inserts, retried only when they failed before their commit (``idempotent=False``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from erase_tune.store.models import (
    FAILURE_KINDS,
    OUTCOME_STATUSES,
    BaselineRow,
    ConfirmationRow,
    ExportRow,
    NoiseFloorRow,
    QualityConfirmationRow,
    TrialOutcomeRow,
)
from erase_tune.store.retry import Retrier, retried
from erase_tune.store.values import (
    BaselineEntry,
    Confirmation,
    ConfirmationRecord,
    Export,
    Job,
    OutcomeRecord,
    QualityConfirmation,
    QualityRecord,
    StoredNoiseFloor,
    StoredOutcome,
    json_safe,
    utc_now,
)

__all__ = ["Results"]

_V = TypeVar("_V")


def _samples(samples: Mapping[str, Any]) -> dict[str, Any]:
    """Per-variant samples as plain JSON (numpy values included; NaN as None)."""
    return json_safe(dict(samples), where="samples")


class Results:
    """Mixed into :class:`~erase_tune.store.Store`, which provides the session, upsert and retries."""

    retry: Retrier

    def _session(self) -> AbstractContextManager[Session]:
        raise TypeError("Results is a part of Store")  # pragma: no cover - Store overrides it

    def _insert(self, table: type) -> Any:
        raise TypeError("Results is a part of Store")  # pragma: no cover - Store overrides it

    def _added(self, row: Any, value: Callable[[Any], _V]) -> _V:
        """Insert ``row`` (a record kept as a history) and return it as ``value`` makes it."""
        with self._session() as s:
            s.add(row)
            s.flush()
            return value(row)

    def _one_or_none(self, stmt: Any, value: Callable[[Any], _V]) -> _V | None:
        """The one row ``stmt`` selects as ``value`` makes it, or None when it selects none."""
        with self._session() as s:
            row = s.scalars(stmt).one_or_none()
            return None if row is None else value(row)

    def _job_rows(self, table: Any, job: Job, value: Callable[[Any], _V]) -> list[_V]:
        """The job's rows of ``table``, oldest first (creation time, then id), as ``value`` makes them."""
        stmt = select(table).where(table.job_id == job.id).order_by(table.created_at, table.id)
        with self._session() as s:
            return [value(r) for r in s.scalars(stmt)]

    # -- trial outcomes -------------------------------------------------------------------

    @retried("recording a trial's outcome")
    def record_outcome(self, job: Job, trial_number: int, record: OutcomeRecord) -> StoredOutcome:
        """Record what trial ``trial_number`` of ``job`` sent back. Idempotent on (job, trial
        number): a repeated write (a retry after a lost connection) replaces the row."""
        r = record
        if r.status not in OUTCOME_STATUSES:
            raise ValueError(f"outcome status {r.status!r} is not one of {', '.join(OUTCOME_STATUSES)}")
        if r.failure_kind is not None and r.failure_kind not in FAILURE_KINDS:
            raise ValueError(f"failure kind {r.failure_kind!r} is not one of {', '.join(FAILURE_KINDS)}")
        fields = dict(
            plan_yaml=r.plan_yaml, status=r.status, failure_kind=r.failure_kind, failure_reason=r.failure_reason,
            traceback=r.traceback, attempts=r.attempts, node=r.node, samples=_samples(r.samples),
            provenance=json_safe(dict(r.provenance), where="provenance"),
        )
        insert = self._insert(TrialOutcomeRow).values(job_id=job.id, trial_number=trial_number, created_at=utc_now(),
                                                      **fields)
        stmt = insert.on_conflict_do_update(
            index_elements=["job_id", "trial_number"],
            set_={name: getattr(insert.excluded, name) for name in fields},
        ).returning(TrialOutcomeRow)
        with self._session() as s:
            return _outcome(s.scalars(stmt, execution_options={"populate_existing": True}).one())

    @retried("reading a trial's outcome")
    def outcome(self, job: Job, trial_number: int) -> StoredOutcome | None:
        """Trial ``trial_number``'s outcome, or None if it has none (still running, stale, a repeat)."""
        stmt = select(TrialOutcomeRow).where(TrialOutcomeRow.job_id == job.id,
                                             TrialOutcomeRow.trial_number == trial_number)
        return self._one_or_none(stmt, _outcome)

    @retried("reading the job's outcomes")
    def latest_provenance(self, job: Job) -> dict[str, Any] | None:
        """Provenance of the job's most recent measured trial (device and versions), if any."""
        stmt = (select(TrialOutcomeRow.provenance)
                .where(TrialOutcomeRow.job_id == job.id, TrialOutcomeRow.status == "complete")
                .order_by(TrialOutcomeRow.created_at.desc(), TrialOutcomeRow.id.desc()).limit(1))
        return self._one_or_none(stmt, dict)

    # -- confirmations -------------------------------------------------------------------

    @retried("recording a confirmation", idempotent=False)
    def record_confirmation(self, job: Job, trial_number: int, record: ConfirmationRecord) -> Confirmation:
        """Keep a confirming measurement of trial ``trial_number``'s plan."""
        r = record
        row = ConfirmationRow(job_id=job.id, trial_number=trial_number, plan_yaml=r.plan_yaml, gain_over=r.gain_over,
                              windows=r.windows, gain=r.gain, gain_lo=r.gain_lo, gain_hi=r.gain_hi,
                              samples=_samples(r.samples), provenance=json_safe(dict(r.provenance), where="provenance"),
                              created_at=utc_now())
        return self._added(row, _confirmation)

    @retried("reading the confirmations")
    def confirmations(self, job: Job) -> list[Confirmation]:
        """The job's confirmations, oldest first."""
        return self._job_rows(ConfirmationRow, job, _confirmation)

    # -- noise floor and quality ----------------------------------------------------------

    @retried("recording the noise floor", idempotent=False)
    def record_noise_floor(self, job: Job, floor: Mapping[str, Any]) -> StoredNoiseFloor:
        """Keep a job's noise floor (``erase_tune.measure.noise.NoiseFloor.to_dict()``)."""
        row = NoiseFloorRow(job_id=job.id, band=float(floor["band"]), ne_reference=float(floor["ne_reference"]),
                            training_steps=int(floor["training_steps"]), repeats=int(floor["repeats"]),
                            gaps=json_safe({"gaps": list(floor["gaps"]), "kinds": list(floor["kinds"]),
                                            "baseline_ne": dict(floor.get("baseline_ne") or {})}, where="gaps"),
                            provenance=json_safe(dict(floor.get("provenance") or {}), where="provenance"),
                            created_at=utc_now())
        return self._added(row, _noise_floor)

    @retried("reading the noise floor")
    def noise_floor(self, job: Job) -> StoredNoiseFloor | None:
        """The job's latest noise floor, if measured."""
        stmt = (select(NoiseFloorRow).where(NoiseFloorRow.job_id == job.id)
                .order_by(NoiseFloorRow.created_at.desc(), NoiseFloorRow.id.desc()).limit(1))
        return self._one_or_none(stmt, _noise_floor)

    @retried("recording a quality confirmation", idempotent=False)
    def record_quality(self, job: Job, trial_number: int, record: QualityRecord) -> QualityConfirmation:
        """Keep a quality confirmation of trial ``trial_number``'s plan."""
        r = record
        row = QualityConfirmationRow(
            job_id=job.id, trial_number=trial_number, plan_yaml=r.plan_yaml, steps=r.steps, seeds=r.seeds,
            ne_gap=r.ne_gap, ne_gap_lo=r.ne_gap_lo, ne_gap_hi=r.ne_gap_hi,
            detail=json_safe({"per_seed": list(r.per_seed), "exact": bool(r.exact), "band": float(r.band)},
                             where="detail"),
            provenance=json_safe(dict(r.provenance), where="provenance"), created_at=utc_now())
        return self._added(row, _quality)

    @retried("reading the quality confirmations")
    def quality_confirmations(self, job: Job) -> list[QualityConfirmation]:
        """The job's quality confirmations, oldest first."""
        return self._job_rows(QualityConfirmationRow, job, _quality)

    # -- baseline cache ------------------------------------------------------------------

    @retried("reading the baseline cache")
    def get_baseline(self, key: str) -> BaselineEntry | None:
        """The cached baseline for ``key`` (see :func:`~erase_tune.store.baseline_key`)."""
        return self._one_or_none(select(BaselineRow).where(BaselineRow.key == key), _baseline)

    @retried("writing the baseline cache")
    def put_baseline(
        self, key: str, metrics: Mapping[str, Any], samples: Mapping[str, Sequence[float]]
    ) -> BaselineEntry:
        """Cache a baseline measurement; a later measurement under the same key replaces it."""
        fields = dict(
            metrics=json_safe(dict(metrics), where="metrics"),
            samples=_samples(samples),
            created_at=utc_now(),
        )
        insert = self._insert(BaselineRow).values(key=key, **fields)
        stmt = insert.on_conflict_do_update(
            index_elements=["key"], set_={name: getattr(insert.excluded, name) for name in fields}
        ).returning(BaselineRow)
        with self._session() as s:
            return _baseline(s.scalars(stmt, execution_options={"populate_existing": True}).one())

    # -- exports -------------------------------------------------------------------------

    @retried("recording an export", idempotent=False)
    def record_export(self, job: Job, trial_number: int, path: str | os.PathLike[str], plan_yaml: str) -> Export:
        """Remember that trial ``trial_number``'s plan was written to ``path``."""
        row = ExportRow(job_id=job.id, optuna_trial_number=trial_number, path=str(path),
                        plan_yaml=plan_yaml, created_at=utc_now())
        return self._added(row, _export)

    @retried("reading the exports")
    def exports(self, job: Job) -> list[Export]:
        """The job's exports, oldest first."""
        return self._job_rows(ExportRow, job, _export)


# -- rows to values (only ever called inside a session) ----------------------------------


def _outcome(r: TrialOutcomeRow) -> StoredOutcome:
    return StoredOutcome(
        job_id=r.job_id, trial_number=r.trial_number, plan_yaml=r.plan_yaml, status=r.status,  # type: ignore[arg-type]
        failure_kind=r.failure_kind, failure_reason=r.failure_reason, traceback=r.traceback,  # type: ignore[arg-type]
        attempts=r.attempts, node=r.node, samples=dict(r.samples), provenance=dict(r.provenance),
        created_at=r.created_at,
    )


def _confirmation(r: ConfirmationRow) -> Confirmation:
    return Confirmation(
        job_id=r.job_id, trial_number=r.trial_number, plan_yaml=r.plan_yaml, gain_over=r.gain_over,
        windows=r.windows, gain=r.gain, gain_lo=r.gain_lo, gain_hi=r.gain_hi, samples=dict(r.samples),
        provenance=dict(r.provenance), created_at=r.created_at,
    )


def _noise_floor(r: NoiseFloorRow) -> StoredNoiseFloor:
    return StoredNoiseFloor(
        job_id=r.job_id, band=r.band, ne_reference=r.ne_reference, training_steps=r.training_steps,
        repeats=r.repeats, gaps=tuple(r.gaps.get("gaps") or ()), kinds=tuple(r.gaps.get("kinds") or ()),
        baseline_ne=dict(r.gaps.get("baseline_ne") or {}), provenance=dict(r.provenance), created_at=r.created_at,
    )


def _quality(r: QualityConfirmationRow) -> QualityConfirmation:
    d = dict(r.detail)
    return QualityConfirmation(
        job_id=r.job_id, trial_number=r.trial_number, plan_yaml=r.plan_yaml, steps=r.steps, seeds=r.seeds,
        ne_gap=r.ne_gap, ne_gap_lo=r.ne_gap_lo, ne_gap_hi=r.ne_gap_hi, per_seed=tuple(d.get("per_seed") or ()),
        exact=bool(d.get("exact")), band=float(d.get("band") or 0.0), provenance=dict(r.provenance),
        created_at=r.created_at,
    )


def _baseline(r: BaselineRow) -> BaselineEntry:
    return BaselineEntry(
        key=r.key, metrics=dict(r.metrics), samples={k: list(v) for k, v in r.samples.items()},
        created_at=r.created_at,
    )


def _export(r: ExportRow) -> Export:
    return Export(
        id=r.id, job_id=r.job_id, trial_number=r.optuna_trial_number, path=r.path,
        plan_yaml=r.plan_yaml, created_at=r.created_at,
    )
