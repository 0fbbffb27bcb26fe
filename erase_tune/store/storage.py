"""One opener for a storage URL: Optuna's ``RDBStorage`` and erase-tune's :class:`Store` on
one engine, behind one retry policy, and a lock that several drivers share.

- :func:`open_storage` builds Optuna's storage with :func:`~erase_tune.store.engine.engine_kwargs`
  and hands the same engine to the :class:`Store`, so the two always behave alike (SQLite:
  WAL, busy timeout, ``BEGIN IMMEDIATE``). Schema set-up (Optuna's ``create_all`` and our
  Alembic upgrade) runs under the storage's lock: drivers that start at the same moment
  on a fresh database queue instead of racing each other into duplicate-key errors.
- :meth:`Storage.lock` is a cross-process lock: a PostgreSQL advisory lock (released by the
  server if its holder dies), or an exclusive ``flock`` on a file next to a SQLite database
  (one machine, as SQLite itself).
- Every call through :attr:`Storage.optuna` (a
  :class:`~erase_tune.store.optuna_storage.RetryingStorage`) and :attr:`Storage.store` is
  retried while the storage is away (:mod:`erase_tune.store.retry`); when it stays away the
  call raises :class:`StorageLost` (the CLI's exit code 3). :meth:`Storage.once` turns that off
  for best-effort writes after a loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import optuna
from sqlalchemy import Connection, Engine, create_engine, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from erase_tune import errors
from erase_tune._env import env_seconds
from erase_tune.errors import EraseTuneError
from erase_tune.store.engine import (
    PG_CONNECT_TIMEOUT_S,
    WRITE_OPTION,
    _is_sqlite_memory,
    connect_args,
    engine_kwargs,
    parse_url,
    redact_url,
    shown_url,
)
from erase_tune.store.optuna_storage import RetryingStorage
from erase_tune.store.models import VERSION_TABLE
from erase_tune.store.repo import Store
from erase_tune.store.retry import RETRY_ENV, Retrier, StorageLost, cause, retrying

CONSTRAINTS = "constraints"
"""The system attribute Optuna's samplers read a trial's constraint values from
(``optuna.samplers._base._CONSTRAINTS_KEY``): ``[ne_gap - (max_ne_gap + band)]``, feasible when
<= 0 (:func:`erase_tune.tune.search.study.constraint`)."""

__all__ = ["Storage", "StorageLost", "open_storage", "retrying", "RETRY_ENV"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Storage:
    """Optuna's storage and erase-tune's tables behind one URL, one engine and one retry policy."""

    url: str
    """The URL with its secrets masked: safe to print."""
    optuna: RetryingStorage
    """What studies are opened on: every call retried (``optuna.rdb`` is Optuna's storage itself)."""
    store: Store
    """erase-tune's tables: every call retried."""
    parsed: URL

    @property
    def retry(self) -> Retrier:
        return self.optuna.retry

    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A lock shared by every process that opens this storage (see the module docstring);
        taking it is retried like any storage call."""
        return _lock(self.parsed, self.optuna.rdb.engine, name,
                     acquire=lambda take: self.retry(f"taking the lock {name!r}", take))

    def once(self) -> contextlib.AbstractContextManager[None]:
        """Storage calls in this block (this thread) are tried once, not retried: for
        best-effort writes once the storage is known to be lost."""
        return self.retry.once()

    def close(self) -> None:
        self.store.close()
        self.optuna.rdb.engine.dispose()

    # -- studies, and what the service does to their trials beside Optuna's Study API ----------
    # (the storage-level calls the driver makes, every one retried like any other)

    def study(self, name: str, *, directions: Sequence[str] | None = None,
              sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
        """The study ``name`` on this storage, every call it makes retried. With ``directions``
        it is created when it is not there yet; without, it must be there."""
        if directions is None:
            return optuna.load_study(study_name=name, storage=self.optuna, sampler=sampler)
        return optuna.create_study(storage=self.optuna, study_name=name, sampler=sampler, directions=list(directions),
                                   load_if_exists=True)

    def study_names(self) -> list[str]:
        """The studies in this storage, by name."""
        return [s.study_name for s in self.optuna.get_all_studies()]

    def study_id(self, study_name: str) -> int:
        """Optuna's id of the study named ``study_name``."""
        return self.optuna.get_study_id_from_name(study_name)

    def trial_id(self, study_id: int, number: int) -> int:
        """Optuna's id of trial ``number`` of study ``study_id``."""
        return self.optuna.get_trial_id_from_study_id_trial_number(study_id, number)

    def trial(self, trial_id: int) -> optuna.trial.FrozenTrial:
        return self.optuna.get_trial(trial_id)

    def set_user_attr(self, trial_id: int, key: str, value: object) -> None:
        self.optuna.set_trial_user_attr(trial_id, key, value)

    def set_user_attrs(self, trial_id: int, attrs: Mapping[str, object]) -> None:
        """Several user attributes at once, in one transaction (all or none)."""
        self.optuna.set_trial_user_attrs(trial_id, attrs)

    def set_constraints(self, trial_id: int, values: list[float]) -> None:
        """The trial's constraint values, where Optuna's multi-objective samplers read them."""
        self.optuna.set_trial_system_attr(trial_id, CONSTRAINTS, values)

    def heartbeat(self, trial_id: int) -> None:
        """This driver still runs the trial (see ``open_storage``'s heartbeat settings)."""
        self.optuna.record_heartbeat(trial_id)

    @property
    def dashboard_storage(self) -> optuna.storages.BaseStorage:
        """Optuna's own storage, without erase-tune's retries, for optuna-dashboard's server (a
        request that fails there fails at once, and the page reloads)."""
        return self.optuna.rdb

    @property
    def grace_period(self) -> int | None:
        """Seconds without a heartbeat after which a trial counts as stale (None: Optuna's default)."""
        return self.optuna.rdb.grace_period


def open_storage(url: str, *, must_exist: bool = False, upgrade: bool = True,
                 heartbeat_interval: int | None = None, grace_period: int | None = None) -> Storage:
    """Open ``url``; with ``must_exist`` a SQLite file that is not there is an error (a reader
    with a typo must not create an empty database); with ``upgrade`` our tables are created
    or migrated. Heartbeat settings go to Optuna (stale trials of dead drivers)."""
    parsed = parse_url(url)
    shown = redact_url(parsed)
    path = _sqlite_path(parsed)
    if must_exist and path is not None and not _is_file(path):
        raise EraseTuneError(f"storage {shown_url(parsed)}: no database file at {errors.one_line(str(path), 300)}")
    kwargs = engine_kwargs(parsed, wal=upgrade)  # a reader changes nothing, not the journal mode either
    # Another process opening the same SQLite file at this moment (a second driver, status, the
    # dashboard: Optuna creates its tables when it opens a storage) can make set-up's deferred
    # transactions fail at once with "database is locked" instead of waiting, or find a table the
    # other process created a moment before ("already exists"): both are retried, within the
    # storage retry window (the next try sees the finished set-up); anything else fails at once.
    deadline = time.monotonic() + env_seconds(RETRY_ENV, 60.0)
    delay = 0.2
    while True:
        try:
            rdb, store = _open_once(url, parsed, kwargs, upgrade, heartbeat_interval, grace_period,
                                    existing=must_exist or not upgrade)
            break
        except Exception as e:  # noqa: BLE001 - any driver/connection error becomes one line
            ours = isinstance(e, EraseTuneError)  # our refusals; and a migration that met a locked file
            why = errors.one_line(str(e) if ours else cause(e, parsed), 300)
            racing = "database is locked" in why or not ours and "already exists" in why  # its tables, beside ours
            if ours and not racing:
                raise
            if racing and time.monotonic() + delay < deadline:
                if delay == 0.2:  # the first wait: say what for, how long, how to stop
                    reason = "database is locked" if "database is locked" in why else why[:80]
                    log.info(f"storage {shown}: another process is setting it up ({reason}); waiting up to "
                             f"{deadline - time.monotonic():.0f}s (${RETRY_ENV}): Ctrl-C stops")
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if ours:
                raise
            raise EraseTuneError(f"storage {shown_url(parsed)}: cannot open: {why}{_timeout_hint(why, parsed)}") \
                from None
    return Storage(url=shown, optuna=RetryingStorage(rdb, store.retry), store=store, parsed=parsed)


def reach_storage(url: str) -> None:
    """Check that a database server answers, before anything else starts (a local Ray, trial
    workers, a wait for GPUs of up to ``--gpu-wait``): a host typo or a wrong password is then
    one line at once, not after minutes; so is a database of another application
    (:func:`_check_tables`). Nothing is created or changed: a SQLite file that is not there is
    left to :func:`open_storage` (its checks are about the path, and opening it may create it)."""
    parsed = parse_url(url)
    engine = None
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_path(parsed)
        if path is None or not _is_file(path):
            return
    else:
        from erase_tune.store.engine import build_engine

        engine = build_engine(parsed)
    try:
        if engine is not None:
            with engine.connect():
                pass
        _check_tables(parsed, reader=False)
    except EraseTuneError:
        raise
    except Exception as e:  # noqa: BLE001 - any driver/connection error, a file that is no database: one line
        why = errors.one_line(cause(e, parsed), 300)
        raise EraseTuneError(f"storage {shown_url(parsed)}: cannot open: {why}{_timeout_hint(why, parsed)}") from None
    finally:
        if engine is not None:
            engine.dispose()


def _timeout_hint(why: str, parsed: URL) -> str:
    """What a connect that timed out means (something answers there, and not as PostgreSQL),
    and how to wait longer for a slow server."""
    if "timeout expired" not in why or "connect_timeout" in parsed.query:
        return ""
    return (f" (no PostgreSQL answer within {PG_CONNECT_TIMEOUT_S} s: is it PostgreSQL at that port? A slow server: "
            "add ?connect_timeout=SECONDS to the URL)")


def _open_once(url: str, parsed: URL, kwargs: dict, upgrade: bool, heartbeat_interval: int | None,
               grace_period: int | None, existing: bool = False) -> tuple[optuna.storages.RDBStorage, Store]:
    setup_engine, rdb = None, None
    try:
        if upgrade and parsed.get_backend_name() == "postgresql":
            # The lock needs a connection before Optuna's engine exists: a short-lived one.
            from erase_tune.store.engine import build_engine

            setup_engine = build_engine(parsed)
        # A reader, or export: a storage of studies, never one set up here; a writer: never a
        # database of another application.
        _check_tables(parsed, reader=existing)
        with _lock(parsed, setup_engine, "schema") if upgrade else contextlib.nullcontext():
            rdb = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_interval,
                                             grace_period=grace_period, skip_compatibility_check=True)
            _check_optuna_schema(rdb)
            # From now on Optuna's transactions take SQLite's write lock up front too, as ours
            # do (engine.SQLiteSettings): several drivers on one file then queue instead of
            # failing when a read turns into a write. (Not during RDBStorage's own set-up,
            # which opens a second connection inside a transaction.)
            rdb.engine.update_execution_options(**{WRITE_OPTION: True})
            store = Store(url, engine=rdb.engine, retry=Retrier(redact_url(parsed), parsed))
            if upgrade:
                store.upgrade()
        return rdb, store
    except BaseException:
        if rdb is not None:  # a failed attempt keeps no connections open
            rdb.engine.dispose()
        raise
    finally:
        if setup_engine is not None:
            setup_engine.dispose()


_OPTUNA_HEAD: list[str] = []
"""The head revision of this Optuna's own migrations, read once per process."""


def _check_optuna_schema(rdb: optuna.storages.RDBStorage) -> None:
    """Optuna's check that the database's Optuna schema is the one this Optuna writes, with the
    head of its migrations read once per process: Optuna's own check parses its twenty-odd
    migration scripts at every open (some 50 ms; a command of the test suite's hostile campaign
    opened a storage 112 times). A database at another revision gets Optuna's own check, and
    its message."""
    manager = rdb._version_manager  # Optuna 5's (pinned); no public name. A test checks the refusal
    if not _OPTUNA_HEAD:
        _OPTUNA_HEAD.append(manager.get_head_version())
    if manager.get_current_version() != _OPTUNA_HEAD[0]:
        manager.check_table_schema_compatibility()  # raises, saying to upgrade Optuna or the storage


OPTUNA_TABLES = frozenset({"studies", "trials", "version_info"})
"""Tables every Optuna storage holds: a database without them is no study storage."""


def _optuna_tables() -> frozenset[str]:
    """Every table of this Optuna's schema (its RDBStorage creates those missing when it opens a
    storage: a reader must find them all)."""
    try:
        from optuna.storages._rdb import models  # the schema has no public name
    except ImportError:  # pragma: no cover - another Optuna layout: the core tables only
        return OPTUNA_TABLES
    return frozenset(models.BaseModel.metadata.tables)


def _check_tables(parsed: URL, *, reader: bool) -> None:
    """Refuse, before anything is written, a database that is not an erase-tune storage.

    Optuna's ``RDBStorage`` creates its tables and stamps its version in whatever database it is
    given, and our SQLite engine turns WAL on: both would change a file that is not ours. So
    the tables are listed first on a plain engine (no WAL, nothing written). A reader (status,
    report, dashboard, ``db current``; export, which needs a study there) opens only a database
    that holds every table of Optuna's schema; a writer (``db upgrade``, ``start``) may set up an
    empty one, or one that is already a storage, never one that holds only another
    application's tables. A refusal is one line, and the database is left byte for byte."""
    if _is_sqlite_memory(parsed):
        return
    engine = create_engine(parsed, poolclass=NullPool, connect_args=connect_args(parsed))
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    shown = shown_url(parsed)
    if reader and not OPTUNA_TABLES <= tables:
        what = "an empty database" if not tables else f"a database of {len(tables)} other tables"
        raise EraseTuneError(f"storage {shown} is not an erase-tune storage ({what}, no Optuna study tables); "
                             "nothing was changed")
    missing = sorted(_optuna_tables() - tables)
    if reader and missing:
        raise EraseTuneError(f"storage {shown} lacks Optuna's table(s) {', '.join(missing)} (dropped?), which reading "
                             f"it would create; nothing was changed (`erase-tune db upgrade --storage {shown}` makes "
                             "them again, empty)")
    ours = tables & (_optuna_tables() | OPTUNA_TABLES | {VERSION_TABLE}) or {t for t in tables if t.startswith("et_")}
    if not reader and tables and not ours:
        listed = ", ".join(sorted(tables)[:3]) + (", …" if len(tables) > 3 else "")
        count = f"{len(tables)} table{'s' if len(tables) > 1 else ''}"
        raise EraseTuneError(f"storage {shown} is a database of another application ({count}: "
                             f"{errors.one_line(listed, 120)}; none of Optuna's or erase-tune's): give erase-tune a "
                             "database of its own; nothing was changed")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, say: no such file either
        return False


def _sqlite_path(url: URL) -> Path | None:
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


_LOCAL_LOCKS: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def _lock(url: URL, engine: Engine | None, name: str,
          acquire: Callable[[Callable[[], Connection]], Connection] | None = None) -> Iterator[None]:
    if url.get_backend_name() == "postgresql":
        assert engine is not None
        key = int.from_bytes(hashlib.sha256(f"erase-tune:{name}".encode()).digest()[:8], "big", signed=True)

        def take() -> Connection:
            conn = engine.connect()
            try:
                _wait_for_lock(lambda: bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()),
                               url, name, "a PostgreSQL advisory lock")
                conn.commit()
            except BaseException:
                conn.invalidate()  # closed for good: a lock it may hold ends with its session
                conn.close()
                raise
            return conn

        conn = acquire(take) if acquire is not None else take()
        try:
            yield
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
            except SQLAlchemyError:
                # The connection broke while locked (the storage was lost): drop it for good, which
                # ends its session and so the lock, and let the locked block's error be the one seen.
                conn.invalidate()
            finally:
                conn.close()
        return
    path = _sqlite_path(url)
    if path is None:  # in-memory: one process by definition
        with _LOCAL_LOCKS.setdefault(name, threading.Lock()):
            yield
        return
    lock_file = path.with_name(f"{path.name}.{hashlib.sha256(name.encode()).hexdigest()[:8]}.lock")
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # Threads of one process share an flock: serialise them first.
        with _LOCAL_LOCKS.setdefault(f"{lock_file}:{name}", threading.Lock()):
            _wait_for_lock(lambda: _try_flock(fd), url, name, f"the file {errors.one_line(str(lock_file), 300)}")
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


LOCK_SAID_S = 1.0
"""A lock still not taken after this long is said to be waited for (one line, within 2 s)."""


def _wait_for_lock(try_take: Callable[[], bool], url: URL, name: str, held_as: str) -> None:
    """Take a lock another process may hold (another driver setting up the storage, or one
    stopped while it held it): said after :data:`LOCK_SAID_S`, given up after the storage's
    retry window (``$ERASE_TUNE_STORAGE_RETRY_S``) as :class:`StorageLost`, never a silent wait
    for good."""
    if try_take():
        return
    began = time.monotonic()
    budget = env_seconds(RETRY_ENV, 60.0)
    said = False
    delay = 0.02
    while not try_take():
        waited = time.monotonic() - began
        if waited >= budget:
            raise StorageLost(f"storage {shown_url(url)}: another process has held its lock {name!r} ({held_as}) for "
                              f"{waited:.0f}s (${RETRY_ENV}): is another erase-tune stuck, or stopped with Ctrl-Z?")
        if not said and waited >= LOCK_SAID_S:
            log.warning(f"storage {shown_url(url)}: another process holds its lock {name!r} ({held_as}); waiting up to "
                        f"{budget:.0f}s (${RETRY_ENV}): Ctrl-C stops")
            said = True
        time.sleep(min(delay, max(0.0, budget - waited)))
        delay = min(delay * 2, 0.25)
