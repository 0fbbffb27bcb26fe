"""The world issue 30's campaign (tests/test_hostile_30.py) points its commands at: a finished
job stored once, copied per case, broken in generated ways; a command runner that times what
the command says on stderr; listeners that are not what an address promises.

Kept apart from the campaign so a case found there can be replayed by hand:
``python -c "from tests.hostile_world_30 import *; w = World(Path('/tmp/w')); print(run(...))"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from erase_tune.cli import main

TINY_SPACE = ("workload: {name: ctr, args: {batch: 16, rows: 10, num_tables: 2, train_batches: 4, eval_batches: 1}}\n"
              "cuts: {candidates: [subarchs.0, subarchs.1], max_streams: 1}\n"
              "sampler: {name: random, seed: 0}\n"
              "budget: {warmup_steps: 5, windows: 1, max_windows: 1, window_steps: 1, timeout_s: 30}\n"
              "trials: 1\ndevice: cpu\n")
"""A space the stored job was made from (``export`` and a resumed ``start`` read it back)."""

EXIT_CODES = {0, 1, 2, 3}


class TimedStream(io.StringIO):
    """stderr that remembers when each line began (seconds since ``t0``): a wait must say
    what it waits for within two seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = time.monotonic()
        self.stamps: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        if text.strip():
            self.stamps.append((time.monotonic() - self.t0, text))
        return super().write(text)


@contextlib.contextmanager
def environment(env: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``env`` applied (None: unset), put back after."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(argv: list[str], env: Mapping[str, str | None] | None = None, stdout: Any = None, stderr: Any = None,
        cwd: Path | None = None) -> tuple[int, str, str, list[tuple[float, str]]]:
    """``erase-tune argv`` in-process: (exit code, stdout, stderr, when each stderr line began).

    ``stdout``/``stderr`` may be text streams of the caller's (a terminal's encoding, /dev/full);
    what a ``TextIOWrapper`` over a ``BytesIO`` took is decoded in its own encoding, strictly."""
    out = stdout if stdout is not None else io.StringIO()
    err = stderr if stderr is not None else TimedStream()
    with environment(env or {}), contextlib.chdir(cwd) if cwd else contextlib.nullcontext(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse: usage errors (2), --help and --version (0)
            code = e.code if isinstance(e.code, int) else 2
    return code, _text(out), _text(err), list(getattr(err, "stamps", []))


def _text(stream: Any) -> str:
    if isinstance(stream, io.StringIO):
        return stream.getvalue()
    if isinstance(stream, io.TextIOWrapper) and isinstance(stream.buffer, io.BytesIO):
        stream.flush()
        return stream.buffer.getvalue().decode(stream.encoding)  # strict: all of it must be in that encoding
    return ""


def digest(path: Path) -> str:
    """The bytes of a file (and of its -wal/-shm companions, if any), hashed."""
    h = hashlib.sha256()
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-journal")):
        if p.exists():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def dump(path: Path) -> str:
    """What a SQLite database holds (its SQL dump, through a read-only connection)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return hashlib.sha256("\n".join(con.iterdump()).encode()).hexdigest()
    finally:
        con.close()


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: directories, files by a digest of their bytes, links by target."""
    out: dict[str, str] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs:
            p = os.path.join(top, name)
            out[os.path.relpath(p, root) + "/"] = "link" if os.path.islink(p) else "dir"
        for name in files:
            p = os.path.join(top, name)
            try:
                out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            except OSError:
                out[os.path.relpath(p, root)] = "unreadable"
    return out


def checkpoint(path: Path) -> None:
    """Fold the WAL into the main file, so a copy is one self-contained file."""
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        con.close()


class Listener:
    """A TCP port where something answers that is not what the address promises: ``silent``
    accepts and never says a word; ``http`` answers every connection with an HTTP error;
    ``garbage`` with bytes of no protocol; ``closer`` hangs up at once."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._serve, name=f"listener-{kind}", daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.kind == "silent":
                self.held.append(conn)  # open, never answered
                continue
            try:
                if self.kind == "http":
                    conn.settimeout(1)
                    with contextlib.suppress(OSError):
                        conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                elif self.kind == "garbage":
                    conn.sendall(b"\x00\xffnot a protocol\r\n" * 4)
            except OSError:
                pass
            finally:
                if self.kind != "silent":
                    conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.held:
            c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """Everything the campaign's commands point at, built once per module.

    ``base.db``: the finished job of tests/tune/studies.py (eager gains), its job row, the front
    confirmed for speed and quality (so ``export`` writes without Ray), at erase-tune's head
    revision, folded into one file. Cases work on copies (:meth:`copy`)."""

    def __init__(self, root: Path) -> None:
        from tests.tune.studies import STUDY_NAME, write_finished_study

        self.root = root
        self.counter = 0
        self.study = STUDY_NAME
        self.space = root / "space.yaml"
        self.space.write_text(TINY_SPACE)
        self.plan = root / "plan.yaml"
        self.plan.write_text("cuts: [subarchs.0]\n")
        self.base = root / "base.db"
        self.url = write_finished_study(self.base, gain_over="eager")
        self._job_and_confirmations(self.url, STUDY_NAME)
        checkpoint(self.base)
        self.listeners = {kind: Listener(kind) for kind in ("silent", "http", "garbage", "closer")}
        self.closed_port = free_port()

    def _job_and_confirmations(self, url: str, name: str) -> None:
        from erase_tune.store.storage import open_storage
        from tests.tune.studies import confirm_front

        db = open_storage(url)
        try:
            confirm_front(db, name, str(self.space), TINY_SPACE)
        finally:
            db.close()

    def fresh_dir(self, stem: str = "case") -> Path:
        self.counter += 1
        d = self.root / f"{stem}-{self.counter}"
        d.mkdir()
        return d

    def copy(self, into: Path | None = None, name: str = "s.db") -> Path:
        """A copy of the base storage, in a directory of its own."""
        d = into or self.fresh_dir("db")
        target = d / name
        shutil.copy(self.base, target)
        return target

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()
