"""The retry policy for a storage that goes away, applied once, at the storage's edge.

Every call that reaches the database through :class:`~erase_tune.store.storage.Storage`
(Optuna's storage, :class:`~erase_tune.store.optuna_storage.RetryingStorage`, and erase-tune's
tables, :class:`~erase_tune.store.Store`) runs through a :class:`Retrier`: a lost connection, a
locked database or a restarting server is retried with backoff for up to
``$ERASE_TUNE_STORAGE_RETRY_S`` seconds (default 60); then, or at once for a read-only
database, the call raises :class:`StorageLost` (one line naming the storage, what was being
done and the database's own message; the CLI's exit code 3). An error no wait can mend (a
missing table or column, a database or file that is gone or is not one: :data:`PERMANENT`) is
not retried: it raises :class:`StorageBroken`, a :class:`StorageLost`, at once. Callers therefore call the
storage directly and never wrap a call in a retry of their own.

A retried call must be safe to repeat. Reads are; so are upserts and attribute writes. A plain
INSERT is not: a commit whose answer was lost may have stored the row, so such a write
(``idempotent=False``) is retried only when it failed before its commit was sent
(:class:`UncertainCommit` marks the other case, which ends in :class:`StorageLost` at once).

``Retrier.once()`` turns retries off for the calling thread: best-effort writes after the
storage was already declared lost (failing the trials of a driver that stops, marking its job
stopped) are tried once instead of waiting out the retry window again.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import optuna
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from erase_tune._env import RETRY_ENV, env_seconds
from erase_tune.errors import EraseTuneError
from erase_tune.store.engine import masked_line

__all__ = ["RETRY_ENV", "PERMANENT", "StorageLost", "StorageBroken", "UncertainCommit", "Retrier", "retrying", "retried", "cause"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("erase_tune.store.storage")


class StorageLost(EraseTuneError):
    """The storage stayed unreachable or unwritable through every retry."""

    exit_code = 3


class StorageBroken(StorageLost):
    """The storage answered with an error that waiting cannot mend (a missing table or column,
    a database or file that is gone or is not one): lost at once, not retried as if it were away
    (a :class:`StorageLost`, so a driver keeps its measurements in the journal as for any loss)."""


PERMANENT = ("no such table", "no such column", "has no column named", "does not exist", "file is not a database",
             "database disk image is malformed")
"""The database's own words for errors no retry can mend (SQLite's and PostgreSQL's)."""


class UncertainCommit(SQLAlchemyError):
    """A commit failed: what it wrote may or may not be stored (the answer was lost)."""


def retrying(what: str, fn: Callable[[], T], *, url: str, parsed: URL | None = None, idempotent: bool = True) -> T:
    """``fn()``, retried with backoff while the storage is unreachable (lost connection,
    locked, server restarting) for up to ``$ERASE_TUNE_STORAGE_RETRY_S`` seconds; then, or at
    once for a read-only database (or an uncertain commit of a write that is not
    ``idempotent``), :class:`StorageLost` naming the storage and the cause."""
    budget = env_seconds(RETRY_ENV, 60.0)
    deadline = time.monotonic() + budget
    delay = 0.2
    while True:
        try:
            return fn()
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
            why = cause(e, parsed)
            if any(w in why.lower() for w in PERMANENT):
                raise StorageBroken(f"storage {url} lost while {what}: {why} (not retried: waiting cannot mend it; "
                                    "`erase-tune db current` says where its erase-tune tables stand)") from None
            repeat_unsafe = not idempotent and isinstance(e, UncertainCommit)
            if repeat_unsafe or "readonly" in why.replace(" ", "").lower() or time.monotonic() + delay > deadline:
                raise StorageLost(f"storage {url} lost while {what}: {why}") from None
            if delay == 0.2:  # the first retry: say what for, how long, how to stop
                log.warning(f"storage {url} unreachable while {what} ({why}); retrying for up to {budget:.0f}s "
                            f"(${RETRY_ENV}): Ctrl-C stops")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def cause(e: BaseException, parsed: URL | None) -> str:
    """The database's own message behind Optuna's and SQLAlchemy's wrappers, on one line
    (Optuna's StorageInternalError says "exceeding max length" whatever went wrong)."""
    seen = e
    for _ in range(8):
        if isinstance(seen, DBAPIError) and seen.orig is not None:
            return masked_line(seen.orig, parsed)
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            break
        seen = nxt
    return masked_line(seen, parsed)


_collection = threading.Lock()
_pauses = [0, False]
"""[storage calls under way with the cyclic collector paused, whether it was enabled before the first]"""


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection while a storage call runs (every thread's calls counted).

    A damaged stored value nested thousands of levels deep is decoded (by Optuna, in C) down to
    the interpreter's recursion limit. A collection that starts there runs other objects'
    finalizers and the collector's callbacks at that depth, where each fails and Python prints
    its traceback ("Exception ignored in ...") beside the command's one line. Garbage waits for
    the next collection after the call; nothing is lost."""
    with _collection:
        if _pauses[0] == 0:
            _pauses[1] = gc.isenabled()
            gc.disable()
        _pauses[0] += 1
    try:
        yield
    finally:
        with _collection:
            _pauses[0] -= 1
            if _pauses[0] == 0 and _pauses[1]:
                gc.enable()


class Retrier:
    """The retry policy of one storage (see the module docstring): shared by its Optuna
    storage and its tables, so that :meth:`once` covers both."""

    def __init__(self, url: str, parsed: URL | None = None) -> None:
        self.url = url
        """The storage URL with its secrets masked: the one named in :class:`StorageLost`."""
        self.parsed = parsed
        self._local = threading.local()

    def __call__(self, what: str, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        def call() -> T:
            with _no_collection():
                return fn()

        try:
            if getattr(self._local, "once", False):
                return call()
            return retrying(what, call, url=self.url, parsed=self.parsed, idempotent=idempotent)
        except (json.JSONDecodeError, RecursionError) as e:
            # A stored attribute or column that is not JSON (edited by hand, a disk error): Optuna's
            # and SQLAlchemy's decoding would end the command in a traceback.
            why = "nested too deeply" if isinstance(e, RecursionError) else f"not JSON: {masked_line(e)}"
            raise EraseTuneError(f"storage {self.url} holds damaged data: while {what}, a stored value is {why}; "
                                 "nothing was changed") from None

    @contextlib.contextmanager
    def once(self) -> Iterator[None]:
        """Calls in this block (this thread) are tried once, not retried."""
        before = getattr(self._local, "once", False)
        self._local.once = True
        try:
            yield
        finally:
            self._local.once = before


def retried(what: str, *, idempotent: bool = True) -> Callable[[F], F]:
    """A method of an object with a ``retry`` :class:`Retrier`, run through it as a whole
    (each attempt in a fresh transaction): ``what`` completes "storage … lost while …"."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.retry(what, lambda: method(self, *args, **kwargs), idempotent=idempotent)

        return run  # type: ignore[return-value]

    return wrap
