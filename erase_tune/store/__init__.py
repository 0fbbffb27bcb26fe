"""erase-tune's own tables (jobs, trial measurements, baseline cache, exports), beside Optuna's.

One SQLAlchemy URL names the storage: ``sqlite:///erase-tune.db`` by default, PostgreSQL for
several workers or machines. :class:`Store` is the whole API; it hands out frozen value
objects, never ORM rows. The schema is migrated by Alembic (``Store.upgrade()``, behind
``erase-tune db upgrade``) with its own version table, and never touches Optuna's tables.

Nothing here connects, or builds an engine, at import time.
"""

from erase_tune.store.engine import SUPPORTED_BACKENDS, default_storage_url, redact_url
from erase_tune.store.migrate import SchemaError, head_revision, upgrade_sql
from erase_tune.store.models import JOB_STATUSES, TRIAL_STATUSES, VERSION_TABLE
from erase_tune.store.repo import Store
from erase_tune.store.values import (
    BaselineEntry,
    Export,
    Job,
    JobStatus,
    TrialMeasurement,
    TrialStatus,
    baseline_key,
)

__all__ = [
    "Store",
    "Job",
    "TrialMeasurement",
    "BaselineEntry",
    "Export",
    "JobStatus",
    "TrialStatus",
    "JOB_STATUSES",
    "TRIAL_STATUSES",
    "VERSION_TABLE",
    "SUPPORTED_BACKENDS",
    "SchemaError",
    "baseline_key",
    "default_storage_url",
    "redact_url",
    "head_revision",
    "upgrade_sql",
]
