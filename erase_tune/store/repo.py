"""The storage API: :class:`Store`, erase-tune's own tables behind one storage URL.

A ``Store`` is cheap to build and thread-safe: it parses the URL at once (so a typo fails
before any work starts) and either shares the engine it is given (the one behind Optuna's
storage, see :func:`erase_tune.store.open_storage`) or creates its own, identically
configured, on first use. Nothing connects at import time. All writes go through :meth:`Store._session`, the
one place that commits or rolls back. Every method that reads or writes a table is retried
while the storage is away (:func:`erase_tune.store.retry.retried`, the store's ``retry``).
Writes that a retry may repeat (a job, a trial result, a baseline) are single-statement
upserts, so two workers, or a worker and its retry, cannot create duplicates or race each
other into an integrity error; a plain insert (a confirmation, an export) is retried only
when it failed before its commit (a failed commit is an :class:`UncertainCommit`).

Before the first read or write, the store checks once that the database is at the
revision this erase-tune needs, so a missing ``erase-tune db upgrade`` is reported as
such instead of as "no such table".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from alembic.util import CommandError
from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from erase_tune.errors import EraseTuneError, shown
from erase_tune.store import migrate
from erase_tune.store.engine import (
    WRITE_OPTION,
    build_engine,
    masked_line,
    parse_url,
    redact_url,
)
from erase_tune.store.models import (
    JOB_STATUSES,
    JobRow,
)
from erase_tune.store.results import Results
from erase_tune.store.retry import Retrier, UncertainCommit, retried
from erase_tune.store.values import (
    Job,
    SchemaVersion,
    json_safe,
    utc_now,
)

__all__ = ["Store"]


class Store(Results):
    """erase-tune's tables in the database named by ``url`` (SQLite or PostgreSQL)."""

    def __init__(self, url: str, *, engine: Engine | None = None, retry: Retrier | None = None) -> None:
        self._url = parse_url(url)
        self._shown_url = redact_url(self._url)
        self.retry = retry if retry is not None else Retrier(self._shown_url, self._url)
        """The retry policy of every table read and write (shared with Optuna's storage when opened with it)."""
        self._lock = threading.Lock()
        self._engine_or_none: Engine | None = engine
        self._owns_engine = engine is None
        self._schema_checked = False

    @property
    def url(self) -> str:
        """The storage URL with its password masked: safe to print."""
        return self._shown_url

    def __repr__(self) -> str:
        return f"Store({self._shown_url!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close all pooled connections of an engine this store made (a shared engine is its
        owner's to close). The store can still be used; it reconnects."""
        with self._lock:
            if self._engine_or_none is not None and self._owns_engine:
                self._engine_or_none.dispose()
                self._engine_or_none = None

    # -- connections and sessions --------------------------------------------------------

    def _engine(self) -> Engine:
        with self._lock:
            if self._engine_or_none is None:
                self._engine_or_none = build_engine(self._url)
            return self._engine_or_none

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A connection, with failure to connect turned into one clear line."""
        try:
            conn = self._engine().connect()
        except DBAPIError as exc:
            raise EraseTuneError(
                f"cannot connect to database {self._shown_url}: {masked_line(exc.orig, self._url)}"
            ) from None
        with conn:
            yield conn.execution_options(**{WRITE_OPTION: True})

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        """The one place that commits (on success) or rolls back (on any error). A commit that
        fails raises :class:`UncertainCommit`: its write may be stored or not."""
        self._ensure_schema()
        with self._connect() as conn, Session(bind=conn, expire_on_commit=False) as session:
            try:
                yield session
            except BaseException:
                session.rollback()
                raise
            try:
                session.commit()
            except SQLAlchemyError as e:
                session.rollback()
                raise UncertainCommit(str(e)) from e

    def _ensure_schema(self) -> None:
        if not self._schema_checked:
            self.check_schema()
            self._schema_checked = True

    def _insert(self, table: type) -> Any:
        """An INSERT that knows ON CONFLICT for this backend (both spell it the same)."""
        dialect = postgresql if self._url.get_backend_name() == "postgresql" else sqlite
        return dialect.insert(table)

    # -- schema --------------------------------------------------------------------------

    def upgrade(self, rev: str = "head") -> None:
        """Create or migrate erase-tune's tables (Alembic, to ``head`` by default)."""
        with self._guard("upgrade"):
            migrate.upgrade(self._connectable(), rev)
        self._schema_checked = False

    def downgrade(self, rev: str = "base") -> None:
        """Migrate back; ``base`` drops erase-tune's tables. Optuna's are never touched."""
        with self._guard("downgrade"):
            migrate.downgrade(self._connectable(), rev)
        self._schema_checked = False

    @retried("reading the schema's revision")
    def schema_version(self) -> SchemaVersion:
        """Where the database's erase-tune tables stand against this erase-tune's migrations."""
        with self._connect() as conn:
            return migrate.schema_version(conn)

    def check_schema(self) -> None:
        """Raise :class:`~erase_tune.store.migrate.SchemaError` unless at our head revision."""
        with self._connect() as conn:
            migrate.check_schema(conn, self._shown_url)

    def _connectable(self) -> Engine:
        # Connect once up front, so an unreachable server gets our one-line message rather
        # than one from inside Alembic.
        with self._connect():
            pass
        return self._engine()

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except (DBAPIError, CommandError) as exc:  # CommandError: e.g. a revision we do not know
            reason = exc.orig if isinstance(exc, DBAPIError) else exc
            why = masked_line(reason, self._url)
            raise EraseTuneError(f"database {what} failed on {self._shown_url}: {why}") from None

    # -- jobs ----------------------------------------------------------------------------

    def create_job(
        self,
        *,
        study_name: str,
        space_path: str | os.PathLike[str],
        space_yaml: str,
        workload: str,
        settings: Mapping[str, Any] | None = None,
        n_trials_target: int | None = None,
        get_or_create: bool = False,
    ) -> Job:
        """Record a new job in status ``running``. If ``study_name`` is taken, raise a
        one-line error, or with ``get_or_create`` return the existing job unchanged."""
        if not study_name:
            raise EraseTuneError("study name must not be empty")
        now = utc_now()
        values = dict(
            study_name=study_name, space_path=str(space_path), space_yaml=space_yaml, workload=workload,
            settings=json_safe(dict(settings or {}), where="settings"), status="running",
            n_trials_target=n_trials_target, error=None, created_at=now, updated_at=now, finished_at=None,
        )
        # ON CONFLICT DO NOTHING, not try/except IntegrityError: two drivers starting the
        # same study at once must both get the one job, and neither a failed transaction.
        # So with get_or_create a repeat finds the job it made; without, it would not.
        stmt = self._insert(JobRow).values(**values).on_conflict_do_nothing(index_elements=["study_name"])
        return self.retry("recording the job", lambda: self._create_job(stmt, study_name, get_or_create),
                          idempotent=get_or_create)

    def _create_job(self, stmt: Any, study_name: str, get_or_create: bool) -> Job:
        with self._session() as s:
            row = s.scalars(stmt.returning(JobRow)).one_or_none()
            if row is None:
                if not get_or_create:
                    raise EraseTuneError(
                        f"a job named {shown(study_name)} already exists in {self._shown_url}: "
                        "choose another study name, or resume that job"
                    )
                row = s.scalars(select(JobRow).where(JobRow.study_name == study_name)).one()
            return _job(row)

    @retried("reading the job")
    def get_job(self, study_name: str) -> Job | None:
        return self._one_or_none(select(JobRow).where(JobRow.study_name == study_name), _job)

    @retried("listing the jobs")
    def list_jobs(self) -> list[Job]:
        """All jobs, oldest first."""
        with self._session() as s:
            return [_job(r) for r in s.scalars(select(JobRow).order_by(JobRow.created_at, JobRow.id))]

    @retried("recording the job's status")
    def set_job_status(self, study_name: str, status: str, error: str | None = None, *,
                       n_trials_target: int | None = None) -> Job:
        """Move a job to ``status``. Leaving ``running`` stamps ``finished_at``; going back
        to ``running`` (a resume) clears it. ``error`` replaces the job's error either way;
        ``n_trials_target``, when given, replaces the job's target (a resume asking for more)."""
        if status not in JOB_STATUSES:
            raise ValueError(f"job status {status!r} is not one of {', '.join(JOB_STATUSES)}")
        now = utc_now()
        values: dict[str, Any] = dict(status=status, error=error, updated_at=now,
                                      finished_at=None if status == "running" else now)
        if n_trials_target is not None:
            values["n_trials_target"] = n_trials_target
        stmt = update(JobRow).where(JobRow.study_name == study_name).values(**values).returning(JobRow)
        with self._session() as s:
            row = s.scalars(stmt, execution_options={"synchronize_session": False}).one_or_none()
            if row is None:
                raise EraseTuneError(f"no job named {shown(study_name)} in {self._shown_url}")
            return _job(row)

# -- rows to values (only ever called inside a session) ----------------------------------


def _job(r: JobRow) -> Job:
    return Job(
        id=r.id, study_name=r.study_name, space_path=r.space_path, space_yaml=r.space_yaml,
        workload=r.workload, settings=dict(r.settings), status=r.status,  # type: ignore[arg-type]
        n_trials_target=r.n_trials_target, error=r.error, created_at=r.created_at,
        updated_at=r.updated_at, finished_at=r.finished_at,
    )

