"""Storage URLs: parse, redact, and turn into a SQLAlchemy engine that fits the backend.

One URL names the storage for Optuna and for erase-tune's own tables. Users type it on the
command line, so everything that can go wrong with it (unparseable, unknown driver, server
unreachable) becomes an :class:`~erase_tune.errors.EraseTuneError` of one line, and no
message built here ever contains the password: URLs are shown through :func:`redact_url`
and driver messages are scrubbed of every secret the URL carried.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import StaticPool

from erase_tune.errors import EraseTuneError

__all__ = ["SUPPORTED_BACKENDS", "default_storage_url", "redact_url", "parse_url", "build_engine", "one_line"]

SUPPORTED_BACKENDS = ("sqlite", "postgresql")
"""The backends the upserts in :mod:`erase_tune.store.repo` are written (and tested) for."""

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another writer's lock before failing."""

# Query parameters that drivers accept as credentials (libpq takes ?password=..., and
# SQLAlchemy's own hide_password only masks the user:password@ part).
_SECRET_QUERY_KEYS = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)
_USERINFO = re.compile(r"(?P<head>://[^/@:]*):[^/@]*@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&][^=&]*(?:pass|pwd|secret|token|key)[^=&]*=)[^&]*", re.IGNORECASE)


def default_storage_url() -> str:
    """The embedded single-machine default: a SQLite file in the working directory."""
    return "sqlite:///erase-tune.db"


def redact_url(url: str | URL) -> str:
    """``url`` as a string that is safe to print or log: password and secret-looking query
    parameters replaced by ``***``. Works on strings SQLAlchemy cannot parse, too."""
    try:
        parsed = url if isinstance(url, URL) else make_url(url)
    except (ArgumentError, ValueError, TypeError):
        text = str(url)
        return _QUERY_SECRET.sub(r"\g<key>***", _USERINFO.sub(r"\g<head>:***@", text))
    return _QUERY_SECRET.sub(r"\g<key>***", parsed.render_as_string(hide_password=True))


def _secrets(url: URL) -> list[str]:
    found = [url.password] if url.password else []
    for key, value in url.query.items():
        if _SECRET_QUERY_KEYS.search(key):
            found.extend([value] if isinstance(value, str) else value)
    # Longest first, so a secret that contains another is masked whole.
    return sorted({str(s) for s in found if s}, key=len, reverse=True)


def one_line(message: object, url: URL | None = None) -> str:
    """A driver's (often multi-line) message squeezed onto one line, secrets masked."""
    text = " ".join(str(message).split())
    for secret in _secrets(url) if url is not None else ():
        text = text.replace(secret, "***")
    return text


def parse_url(url: str) -> URL:
    """Parse and check a storage URL without connecting or importing its driver."""
    if not isinstance(url, str) or not url.strip():
        raise EraseTuneError("storage URL is empty: pass e.g. --storage sqlite:///erase-tune.db")
    try:
        parsed = make_url(url.strip())
    except (ArgumentError, ValueError):
        # SQLAlchemy's own message quotes the raw string, password included: never show it.
        raise EraseTuneError(
            f"cannot parse storage URL {redact_url(url)!r}: expected dialect+driver://user@host/dbname "
            "or sqlite:///path.db"
        ) from None
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise EraseTuneError(
            f"unknown database driver {parsed.drivername!r} in storage URL {redact_url(parsed)}: "
            "use sqlite:///path.db or postgresql+psycopg://user@host/dbname"
        ) from None
    if dialect.name not in SUPPORTED_BACKENDS:
        raise EraseTuneError(
            f"database backend {dialect.name!r} (storage URL {redact_url(parsed)}) is not supported: "
            f"use one of {', '.join(SUPPORTED_BACKENDS)}"
        )
    if getattr(dialect, "is_async", False):
        raise EraseTuneError(
            f"async driver {parsed.drivername!r} in storage URL {redact_url(parsed)} is not supported: "
            "use a synchronous one such as postgresql+psycopg"
        )
    return parsed


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or "mode=memory" in str(url.query.get("mode", ""))


def build_engine(url: URL) -> Engine:
    """An engine configured for the backend. Imports the driver, does not connect."""
    kwargs: dict[str, Any] = {}
    if url.get_backend_name() == "sqlite":
        # Ray workers and the driver's threads share one Store: sqlite3 must not pin a
        # connection to the thread that opened it (the pool already serialises access).
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        if _is_sqlite_memory(url):
            # Every new connection to :memory: is a new, empty database: share one.
            kwargs["poolclass"] = StaticPool
    else:
        # A driver that outlives a database restart must not hand out dead connections.
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(url, **kwargs)
    except (NoSuchModuleError, ImportError) as exc:
        raise EraseTuneError(
            f"cannot load the database driver for storage URL {redact_url(url)}: {one_line(exc, url)}"
        ) from None
    if url.get_backend_name() == "sqlite":
        _configure_sqlite(engine, memory=_is_sqlite_memory(url))
    return engine


def _configure_sqlite(engine: Engine, *, memory: bool) -> None:
    """WAL, busy timeout, foreign keys, and real transactions for SQLite.

    pysqlite's legacy transaction control neither BEGINs before DDL (so a failed migration
    would leave half a schema) nor before SELECT; we take over BEGIN as SQLAlchemy's SQLite
    docs describe. Writers BEGIN IMMEDIATE: they take the write lock up front and wait for
    it (busy timeout) instead of failing when a read transaction tries to upgrade to a write.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            if not memory:
                # WAL lets readers (status, dashboard) proceed while a trial result is written.
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("erase_tune_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
