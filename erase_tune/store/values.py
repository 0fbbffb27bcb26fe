"""Frozen value objects returned by :class:`~erase_tune.store.Store`, and the baseline key.

ORM rows never leave the storage layer: every read and write hands back one of these,
built from a row while its session is open, so callers can keep them across threads and
after the store is closed without lazy loads or detached-instance surprises. The JSON
fields are the caller's own copies (changing them changes nothing in the database).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["JobStatus", "OutcomeStatus", "FailureKind", "SchemaState", "SchemaVersion", "Job", "StoredOutcome",
           "Confirmation", "BaselineEntry",
           "StoredNoiseFloor", "QualityConfirmation", "OutcomeRecord", "ConfirmationRecord", "QualityRecord",
           "Export", "baseline_key", "json_safe", "utc_now"]

JobStatus = Literal["running", "finished", "failed", "interrupted"]
OutcomeStatus = Literal["complete", "failed"]
FailureKind = Literal["trial", "infra"]
SchemaState = Literal["current", "none", "behind", "ahead"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchemaVersion:
    """Where a database's erase-tune tables stand against this erase-tune's migrations."""

    revision: str | None
    """The revision recorded in the database's version table; None: no erase-tune tables yet."""
    head: str
    """The revision this erase-tune's code needs."""
    known: bool
    """``revision`` is one of this erase-tune's migrations (False: a newer erase-tune wrote it)."""

    @property
    def state(self) -> SchemaState:
        """``current`` (at ``head``), ``none`` (never upgraded), ``behind`` (an older revision
        ``erase-tune db upgrade`` migrates) or ``ahead`` (a newer erase-tune's)."""
        if self.revision == self.head:
            return "current"
        if self.revision is None:
            return "none"
        return "behind" if self.known else "ahead"

    def problem(self, shown_url: str) -> str | None:
        """None at ``head``; else the one line that says what to run (``shown_url``: redacted)."""
        state = self.state
        if state == "current":
            return None
        if state == "ahead":
            return (f"database at revision {self.revision}, which this erase-tune does not know (it needs "
                    f"{self.head}): the database was upgraded by a newer erase-tune; upgrade erase-tune")
        shown = self.revision if state == "behind" else "none (erase-tune tables not created)"
        return (f"database at revision {shown}, erase-tune needs {self.head}: "
                f"run `erase-tune db upgrade --storage {shown_url}`")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """A tuning job: one Optuna study and what erase-tune needs to resume and report it."""

    id: int
    study_name: str
    """The Optuna study's name; unique per storage."""
    space_path: str
    """Where the search-space file was read from (informational: it may have moved since)."""
    space_yaml: str
    """The search-space file's text as given, so the job can be resumed without it."""
    workload: str
    """A built-in workload name (``ctr``) or a user's ``package.module:factory``."""
    settings: dict[str, Any]
    """Job settings that do not depend on the storage (budgets, sampler, seeds, ...)."""
    status: JobStatus
    n_trials_target: int | None
    """How many trials the job was asked for; None when it runs until a time budget ends."""
    error: str | None
    """One line saying why the job failed or was interrupted; None otherwise."""
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None
    """When the job last left ``running``; None while it runs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OfTrial:
    """The keys the store adds to what a caller records of one trial's plan: its job and trial."""

    job_id: int
    trial_number: int
    """Optuna's trial number within the job's study."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutcomeRecord:
    """What a caller writes of one trial's outcome (:meth:`~erase_tune.store.Store.record_outcome`):
    a :class:`StoredOutcome` without the keys and the time the store adds."""

    plan_yaml: str
    """The candidate plan as YAML."""
    status: OutcomeStatus
    failure_kind: FailureKind | None = None
    """``trial`` (the plan or workload failed) or ``infra`` (worker, node or environment)."""
    failure_reason: str | None = None
    traceback: str | None = None
    """The worker's traceback of the failure, as it printed it."""
    attempts: int = 1
    """Runs it took: infrastructure failures are retried."""
    node: str | None = None
    """The Ray node (ip/id) the last attempt ran on."""
    samples: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Per variant: ``{"steps_s": [...], "window": [...]}``, per-step seconds and their window."""
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredOutcome(OutcomeRecord, _OfTrial):
    """What one trial's worker sent back, beyond the scalar metrics Optuna keeps: its
    :class:`OutcomeRecord` as stored, after the keys, with the store's copies of the JSON fields
    and the time it was written."""

    samples: dict[str, Any]
    provenance: dict[str, Any]
    created_at: dt.datetime


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmationRecord:
    """What a caller writes of a confirming measurement (:class:`Confirmation` without the
    keys and the time the store adds)."""

    plan_yaml: str
    gain_over: str
    windows: int
    """Timed windows per variant in this measurement."""
    gain: float
    """The gain over the baseline named by ``gain_over`` as the confirmation measured it (now the
    mean over windows of the per-window gain; rows from before the interleaved protocol hold the
    median per-window p90-QPS gain)."""
    gain_lo: float
    gain_hi: float
    """The gain's 95% interval over windows."""
    samples: Mapping[str, Any]
    provenance: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityRecord:
    """What a caller writes of a quality confirmation (:class:`QualityConfirmation` without the
    keys and the time the store adds)."""

    plan_yaml: str
    steps: int
    """Training steps of each run (a multiple of a trial's)."""
    seeds: int
    ne_gap: float
    ne_gap_lo: float
    ne_gap_hi: float
    per_seed: tuple[float, ...]
    exact: bool
    """Exact by construction (no cuts): not trained, its gap is noise."""
    band: float
    """The job's noise floor when this was made."""
    provenance: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Confirmation(ConfirmationRecord, _OfTrial):
    """A second look at a front plan: baseline and plan re-timed, interleaved, in one process.
    Its :class:`ConfirmationRecord` as stored: after the keys, with the store's copies of the
    JSON fields and the time it was written."""

    samples: dict[str, Any]
    provenance: dict[str, Any]
    created_at: dt.datetime


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredNoiseFloor:
    """The noise floor of a job's NE gap (see :mod:`erase_tune.measure.noise`)."""

    job_id: int
    band: float
    """Largest |NE gap| of the baseline against itself under perturbations that cannot matter."""
    ne_reference: float
    training_steps: int
    repeats: int
    gaps: tuple[float, ...]
    kinds: tuple[str, ...]
    provenance: dict[str, Any]
    created_at: dt.datetime
    baseline_ne: dict[str, float] = dataclasses.field(default_factory=dict)
    """The baseline's NE by data-order seed (a JSON object: its keys are strings); empty when
    the floor was stored before it was kept."""

    def to_dict(self) -> dict[str, Any]:
        """The form :meth:`erase_tune.measure.noise.NoiseFloor.from_dict` reads."""
        return {"band": self.band, "gaps": list(self.gaps), "kinds": list(self.kinds),
                "ne_reference": self.ne_reference, "training_steps": self.training_steps, "repeats": self.repeats,
                "provenance": dict(self.provenance), "baseline_ne": dict(self.baseline_ne)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityConfirmation(QualityRecord, _OfTrial):
    """A front plan trained again over several data orders: its NE gap with a 95% interval.
    Its :class:`QualityRecord` as stored: after the keys, with the store's copy of the
    provenance and the time it was written."""

    provenance: dict[str, Any]
    created_at: dt.datetime


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineEntry:
    """A cached baseline measurement (see :func:`baseline_key`): a resumed job reuses its NE."""

    key: str
    metrics: dict[str, Any]
    samples: dict[str, list[float | None]]
    created_at: dt.datetime


@dataclasses.dataclass(frozen=True, kw_only=True)
class Export:
    """A plan file written by ``erase-tune export``."""

    id: int
    job_id: int
    trial_number: int
    path: str
    plan_yaml: str
    """The plan exactly as written, so the file can be recreated or checked for edits."""
    created_at: dt.datetime


def utc_now() -> dt.datetime:
    """The time rows are stamped with (timezone-aware UTC)."""
    return dt.datetime.now(dt.timezone.utc)


def json_safe(value: Any, *, where: str = "value") -> Any:
    """``value`` as plain JSON data: tuples become lists, numpy scalars and arrays become
    Python numbers and lists, and non-finite floats become None, because neither JSON nor
    PostgreSQL's jsonb has NaN or infinity (SQLite would keep them, PostgreSQL would refuse
    the row: both backends must store the same thing)."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, where=f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, without importing numpy
        return json_safe(value.tolist(), where=where)
    raise TypeError(f"{where}: {type(value).__name__} is not JSON data")


def baseline_key(workload: str, args: Mapping[str, Any], device: str, torch_version: str) -> str:
    """The cache key of an eager-baseline measurement: a sha256 hex digest of the workload
    name, its arguments as canonical JSON (sorted keys, fixed separators, so argument order
    does not matter), the device name and the torch version. Any of these changing means
    the baseline must be measured again."""
    canonical = json.dumps(
        {"workload": workload, "args": json_safe(dict(args), where="args"), "device": device, "torch": torch_version},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
