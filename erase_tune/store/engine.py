"""Storage URLs: parse, redact, and turn into a SQLAlchemy engine that fits the backend.

One URL names the storage for Optuna and for erase-tune's own tables. Users type it on the
command line, so everything that can go wrong with it (unparseable, unknown driver, server
unreachable) becomes an :class:`~erase_tune.errors.EraseTuneError` of one line, and no
message built here ever contains the password: URLs are shown through :func:`redact_url`
and driver messages are scrubbed of every secret the URL carried.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import plugins
from sqlalchemy.engine import URL, CreateEnginePlugin, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import NullPool, StaticPool

from erase_tune import errors
from erase_tune._env import env_text
from erase_tune.errors import EraseTuneError

__all__ = ["SUPPORTED_BACKENDS", "STORAGE_ENV", "default_storage_url", "redact_url", "shown_url", "parse_url", "storage_files",
           "engine_kwargs", "connect_args", "build_engine", "masked_line"]

SUPPORTED_BACKENDS = ("sqlite", "postgresql")
"""The backends the upserts in :mod:`erase_tune.store.repo` are written (and tested) for."""

SQLITE_BUSY_TIMEOUT_MS = 1_500
"""How long a SQLite statement waits for another connection's lock before failing. Short: a
lock held longer (another process's open transaction, a stuck writer) becomes an error the
storage's retry policy handles (:mod:`erase_tune.store.retry`), which says within two seconds
what it waits for and waits as long as ``$ERASE_TUNE_STORAGE_RETRY_S`` says, not SQLite's own
silent wait."""

PG_CONNECT_TIMEOUT_S = 2
"""How long one PostgreSQL connection attempt may take (libpq's ``connect_timeout``, whose least
is 2 s): at a port where something that is not PostgreSQL accepts and never answers, a command
would otherwise wait in silence for good. A URL's own ``?connect_timeout=`` wins; a lost
connection is still retried for as long as ``$ERASE_TUNE_STORAGE_RETRY_S`` says."""

# Query parameters that drivers accept as credentials (libpq takes ?password=..., and
# SQLAlchemy's own hide_password only masks the user:password@ part).
_SECRET_QUERY_KEYS = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)
_USERINFO = re.compile(r"(?P<head>://[^/@:]*):[^/@]*@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&][^=&]*(?:pass|pwd|secret|token|key)[^=&]*=)[^&]*", re.IGNORECASE)


STORAGE_ENV = "ERASE_TUNE_STORAGE"
"""The environment variable that names the storage when ``--storage`` is not given."""


def default_storage_url() -> str:
    """``$ERASE_TUNE_STORAGE`` if set, else the embedded single-machine default: a SQLite
    file in the working directory. (An empty ``--storage`` is an error, not this default.)"""
    return env_text(STORAGE_ENV) or "sqlite:///erase-tune.db"


def redact_url(url: str | URL) -> str:
    """``url`` as a string that is safe to print or log: password and secret-looking query
    parameters replaced by ``***``. Works on strings SQLAlchemy cannot parse, too."""
    try:
        parsed = url if isinstance(url, URL) else make_url(url)
    except (ArgumentError, ValueError, TypeError):
        text = str(url)
        return _QUERY_SECRET.sub(r"\g<key>***", _USERINFO.sub(r"\g<head>:***@", text))
    return _QUERY_SECRET.sub(r"\g<key>***", parsed.render_as_string(hide_password=True))


def shown_url(url: str | URL, limit: int = 300) -> str:
    """:func:`redact_url` for an error message: one line, at most ``limit`` characters."""
    return errors.one_line(redact_url(url), limit)


def _secrets(url: URL) -> list[str]:
    found = [url.password] if url.password else []
    for key, value in url.query.items():
        if _SECRET_QUERY_KEYS.search(key):
            found.extend([value] if isinstance(value, str) else value)
    # Longest first, so a secret that contains another is masked whole.
    return sorted({str(s) for s in found if s}, key=len, reverse=True)


def masked_line(message: object, url: URL | None = None) -> str:
    """A driver's (often multi-line) message on one line (:func:`erase_tune.errors.one_line`),
    the secrets of ``url`` masked."""
    text = errors.one_line(message, squeeze=True)
    for secret in _secrets(url) if url is not None else ():
        text = text.replace(secret, "***")
    return text


def parse_url(url: str) -> URL:
    """Parse and check a storage URL without connecting or importing its driver."""
    if not isinstance(url, str) or not url.strip():
        raise EraseTuneError("storage URL is empty: pass e.g. --storage sqlite:///erase-tune.db")
    if url != url.strip():  # Optuna opens the URL as given: a SQLite file whose name ends in a space
        raise EraseTuneError(f"storage URL '{shown_url(url)}' begins or ends with white space (copied along?): "
                             "remove it")
    if not url.isprintable():  # a zero-width space or a control character: a file of another name
        odd = next(c for c in url if not c.isprintable())
        raise EraseTuneError(f"storage URL '{shown_url(url)}' holds the invisible or control character "
                             f"{odd.encode('unicode_escape').decode('ascii')} (copied along?): remove it")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        # SQLAlchemy's own message quotes the raw string, password included: never show it.
        raise EraseTuneError(
            f"cannot parse storage URL '{shown_url(url)}': expected dialect+driver://user@host/dbname "
            "or sqlite:///path.db"
        ) from None
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise EraseTuneError(
            f"unknown database driver {parsed.drivername!r} in storage URL {shown_url(parsed)}: "
            "use sqlite:///path.db or postgresql+psycopg://user@host/dbname"
        ) from None
    if dialect.name not in SUPPORTED_BACKENDS:
        raise EraseTuneError(
            f"database backend {dialect.name!r} (storage URL {shown_url(parsed)}) is not supported: "
            f"use one of {', '.join(SUPPORTED_BACKENDS)}"
        )
    if dialect.name == "sqlite" and parsed.query:
        # pysqlite ignores ?mode=ro without uri=true (a reader's "read-only" would write), and with it
        # reads the path as a URI: erase-tune opens the file itself (WAL, its busy timeout), and a
        # command that only reads never writes.
        raise EraseTuneError(
            f"storage URL {shown_url(parsed)}: SQLite options in the URL ({', '.join(sorted(parsed.query))}) are not "
            f"supported: give the plain path, sqlite:///{parsed.database or ''}")
    if getattr(dialect, "is_async", False):
        raise EraseTuneError(
            f"async driver {parsed.drivername!r} in storage URL {shown_url(parsed)} is not supported: "
            "use a synchronous one such as postgresql+psycopg"
        )
    return parsed


def storage_files(url: str | None) -> list[Path]:
    """The files of a SQLite storage (database, journal, WAL, shared memory) that no ``-o``
    may replace; none for a server database. A URL that does not parse protects nothing here:
    opening the storage reports it."""
    try:
        parsed = parse_url(url if url is not None else default_storage_url())
    except EraseTuneError:
        return []
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return []
    db = Path(os.path.realpath(parsed.database))  # SQLite puts its journal files next to the real file
    return [db, *(db.with_name(db.name + suffix) for suffix in ("-journal", "-wal", "-shm"))]


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or "mode=memory" in str(url.query.get("mode", ""))


def engine_kwargs(url: URL, *, wal: bool = True) -> dict[str, Any]:
    """The ``create_engine`` arguments for ``url``: the one configuration that both Optuna's
    storage and erase-tune's tables use (``RDBStorage(engine_kwargs=...)`` and
    :func:`build_engine`), so a storage URL never yields two differently behaving engines."""
    kwargs: dict[str, Any] = {}
    if url.get_backend_name() == "sqlite":
        # Ray workers and the driver's threads share connections: sqlite3 must not pin a
        # connection to the thread that opened it (the pool already serialises access).
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        kwargs["plugins"] = [_SQLITE_PLUGIN]
        # A command that only reads leaves the file's journal mode as it is (a plain Optuna
        # storage is not made a WAL database by status); erase-tune's own are WAL from the start.
        kwargs[WAL_OPTION] = wal
        # :memory: is a new, empty database per connection: share one. A file gets a fresh
        # connection per use (cheap for SQLite): a pooled handle would hide the file being
        # made read-only or replaced until much later, and hold it open meanwhile.
        kwargs["poolclass"] = StaticPool if _is_sqlite_memory(url) else NullPool
    else:
        # A driver that outlives a database restart must not hand out dead connections.
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = connect_args(url)
    return kwargs


def connect_args(url: URL) -> dict[str, Any]:
    """What every connection to ``url`` is opened with besides the URL: a bounded connect on
    PostgreSQL (:data:`PG_CONNECT_TIMEOUT_S`), unless the URL sets its own."""
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        return {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return {}


def build_engine(url: URL) -> Engine:
    """An engine configured by :func:`engine_kwargs`. Imports the driver, does not connect."""
    try:
        return create_engine(url, **engine_kwargs(url))
    except (NoSuchModuleError, ImportError) as exc:
        raise EraseTuneError(
            f"cannot load the database driver for storage URL {shown_url(url)}: {masked_line(exc, url)}"
        ) from None


class SQLiteSettings(CreateEnginePlugin):
    """WAL, busy timeout, foreign keys, and real transactions for every SQLite engine.

    Loaded by name through ``create_engine(plugins=[...])``, so it also configures the engine
    Optuna builds inside ``RDBStorage`` before that engine's first connection.

    pysqlite's legacy transaction control neither BEGINs before DDL (so a failed migration
    would leave half a schema) nor before SELECT; we take over BEGIN as SQLAlchemy's SQLite
    docs describe. erase-tune's own transactions (:data:`WRITE_OPTION`) are ``BEGIN
    IMMEDIATE``: they take the write lock up front and wait for it (busy timeout), so two
    processes on one file queue instead of failing with "database is locked" when a read
    transaction tries to upgrade to a write. Optuna's own are plain ``BEGIN`` (it opens a
    second connection inside a transaction, which IMMEDIATE would deadlock); the storage
    retries those on a lock (:mod:`erase_tune.store.retry`).
    """

    def __init__(self, url: URL, kwargs: dict[str, Any]) -> None:
        super().__init__(url, kwargs)
        self.wal = kwargs.pop(WAL_OPTION, True)

    def update_url(self, url: URL) -> URL:
        return url  # the plugin takes no arguments from the URL

    def engine_created(self, engine: Engine) -> None:
        keep_journal_mode = _is_sqlite_memory(engine.url) or not self.wal

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                if not keep_journal_mode:
                    # WAL lets readers (status, dashboard) proceed while a result is written;
                    # with WAL, synchronous=NORMAL is crash-safe for the application and skips
                    # an fsync per commit (a trial writes a few dozen attributes).
                    cursor.execute("PRAGMA journal_mode=WAL")
                    cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                cursor.execute("PRAGMA foreign_keys=ON")
            finally:
                cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION) else "BEGIN")

        @event.listens_for(engine, "handle_error")
        def _on_interrupt(ctx: Any) -> None:
            # Ctrl-C or SIGTERM inside a statement (an exit exception): SQLAlchemy then closes the
            # connection but not the statement's cursor, and pysqlite (Python 3.11+) keeps a
            # database with an unfinished statement open, transaction and write lock included,
            # until that cursor is collected. The traceback holding it lives on through the
            # command's clean-up, whose writes (failing its trials) waited 30 s for the lock and
            # failed: a trial stayed RUNNING after SIGTERM. Closing the cursor first lets the close
            # end the transaction at once.
            cursor = getattr(ctx.execution_context, "cursor", None)
            if ctx.is_disconnect and cursor is not None and not isinstance(ctx.original_exception, Exception):
                with contextlib.suppress(Exception):
                    cursor.close()


_SQLITE_PLUGIN = "erase_tune_sqlite"
WAL_OPTION = "erase_tune_wal"
"""``create_engine`` argument the plugin takes: whether its connections turn WAL on (writers)."""
WRITE_OPTION = "erase_tune_write"
"""Execution option marking erase-tune's own connections (``BEGIN IMMEDIATE`` on SQLite)."""
plugins.register(_SQLITE_PLUGIN, __name__, "SQLiteSettings")
