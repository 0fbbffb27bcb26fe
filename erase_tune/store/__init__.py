"""erase-tune's own tables (jobs, trial outcomes, baseline cache, confirmations, noise floors, exports), beside
Optuna's, and the one opener that gives both from one storage URL.

One SQLAlchemy URL names the storage: ``sqlite:///erase-tune.db`` by default, PostgreSQL for
several workers or machines. :class:`Store` is the whole API; it hands out frozen value
objects, never ORM rows. The schema is migrated by Alembic (``Store.upgrade()``, behind
``erase-tune db upgrade``) with its own version table, and never touches Optuna's tables.

Nothing here connects, or builds an engine, at import time.
"""

from erase_tune.store.engine import (
    STORAGE_ENV,
    SUPPORTED_BACKENDS,
    default_storage_url,
    redact_url,
)
from erase_tune.store.migrate import SchemaError, head_revision, upgrade_sql
from erase_tune.store.models import (
    FAILURE_KINDS,
    JOB_STATUSES,
    OUTCOME_STATUSES,
    VERSION_TABLE,
)
from erase_tune.store.repo import Store
from erase_tune.store.values import (
    BaselineEntry,
    Confirmation,
    ConfirmationRecord,
    Export,
    Job,
    JobStatus,
    OutcomeRecord,
    QualityConfirmation,
    QualityRecord,
    SchemaVersion,
    StoredNoiseFloor,
    StoredOutcome,
    baseline_key,
)

__all__ = [
    "Store",
    "Job",
    "StoredOutcome",
    "Confirmation",
    "QualityConfirmation",
    "OutcomeRecord",
    "ConfirmationRecord",
    "QualityRecord",
    "StoredNoiseFloor",
    "SchemaVersion",
    "BaselineEntry",
    "Export",
    "JobStatus",
    "JOB_STATUSES",
    "OUTCOME_STATUSES",
    "FAILURE_KINDS",
    "STORAGE_ENV",
    "VERSION_TABLE",
    "SUPPORTED_BACKENDS",
    "SchemaError",
    "baseline_key",
    "default_storage_url",
    "redact_url",
    "head_revision",
    "upgrade_sql",
]
