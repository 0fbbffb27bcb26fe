"""How a command ends on Ctrl-C, SIGTERM and SIGHUP: one line, exit 130 / 143 / 129.

The first signal raises where the command stands (``KeyboardInterrupt``, or
:class:`~erase_tune.errors.Terminated`, one of its kind), so it unwinds as Ctrl-C would:
trials cancelled, the job marked interrupted, storage left consistent. Two things can keep
that from happening, both seen with users' workload factories: code that catches the
exception and carries on (``except BaseException: pass``), and a long computation in C
(one huge matrix product) during which Python cannot run the handler at all. So a watcher
thread hears every signal through :func:`signal.set_wakeup_fd`, which the interpreter writes
from the C-level handler at once: if the command has not ended 2 s after the first signal, it
says what it waits for; a second signal ends the process at once, without the unwinding.

A stopped command also ends by itself: ``$ERASE_TUNE_STOP_LIMIT_S`` (25 s) after the first
signal (a main thread stuck in a call that never returns: Ray waiting on a GCS the same signal
stopped, when a whole process group was signalled), the watcher ends the process, naming where
the main thread stood. And once the command has stopped, its process ends at once
(:func:`exit_now`), past other libraries' exit hooks: Ray's ``shutdown`` waits a minute for that
GCS and then exits 1.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from erase_tune._env import STOP_ENV, env_stop_limit_s
from erase_tune.errors import Terminated

__all__ = ["on_signals", "received", "first_signal", "signals_deferred", "stopped", "sigterm_kept", "terminate",
           "stuck_thread", "exit_now"]

SAY_AFTER_S = 2.0
"""How long after the first signal the command says, if it is still running, what it waits for."""

received: list[int] = []
"""Signals received while a command ran. Some servers (the dashboard's) catch KeyboardInterrupt
themselves and return normally: the command's exit must still say it was stopped."""

_heard: list[int] = []
"""Signals the watcher heard, whichever handler ran for them (or none could yet)."""

_watching: list[_Watcher] = []
"""The running command's watcher, while it runs."""


def first_signal() -> int | None:
    """The first signal that came while the command ran, if one did: what our handler received,
    else what the watcher heard (a library's handler in place of ours: Ray's ``sys.exit``)."""
    if not received and not _heard:
        for watcher in _watching:
            watcher.hear()
    return received[0] if received else _heard[0] if _heard else None

_HANDLED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


_deferring = 0
"""Depth of :func:`signals_deferred` blocks the main thread is in."""
_pending: list[int] = []
"""Signals received inside them, raised when the outermost ends."""


def terminate(signum: int, frame: Any) -> None:
    received.append(signum)
    if _deferring:
        _pending.append(signum)
        return
    raise Terminated(signum)


def _interrupt(signum: int, frame: Any) -> None:
    received.append(signum)
    if _deferring:
        _pending.append(signum)
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold the first Ctrl-C, SIGTERM or SIGHUP until the block ends, then raise it as it would
    have been raised, in place of anything the block raised. For a few writes that must not be
    cut in half (Optuna's ``ask()``: a trial created RUNNING whose number the caller never
    learns), never for anything that may block long: a second signal still ends the process
    at once. Main thread only, as the handlers run there."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending:
            signum = _pending[0]
            _pending.clear()
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)  # noqa: B012


def stopped(signum: int) -> int:
    """Say that the command was stopped by ``signum``; its exit code (128 + N, as a shell reports it)."""
    print(_stopped_line(signum), file=sys.stderr)
    return 128 + signum


RESEND_AFTER_S = 0.05
"""How long after Python swallowed a signal's exception (see :func:`_unraisable`) it is sent again."""

_resent = [0]
"""Signals sent again by this module, not yet read by the watcher (not a user's second signal)."""
_resent_lock = threading.Lock()


def _resend(signum: int) -> None:
    if signal.getsignal(signum) not in (terminate, _interrupt):  # the command has ended: nothing to stop
        return
    with _resent_lock:
        _resent[0] += 1
    signal.pthread_kill(threading.main_thread().ident, signum)


def _was_resent() -> bool:
    with _resent_lock:
        if _resent[0]:
            _resent[0] -= 1
            return True
    return False


def _unraisable(previous: Callable[[Any], Any]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook`` that gives back a signal Python swallowed.

    A handler raises where the main thread stands, and that may be inside a finalizer or a weakref
    callback run by the garbage collector (seen: SQLAlchemy's class registry, while the dashboard
    started). Python cannot raise from there: it prints the exception as "Exception ignored in"
    with a traceback and goes on, and the command never stops (the dashboard served on). This
    hook prints nothing for it and sends the signal to the main thread again a moment later, once
    that code has returned, to be raised where the command stands then."""

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if received and isinstance(exc, (Terminated, KeyboardInterrupt)):
            signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            timer = threading.Timer(RESEND_AFTER_S, _resend, args=(signum,))
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    return hook


def _stopped_line(signum: int) -> str:
    if signum == signal.SIGINT:
        return "erase-tune: interrupted"
    return f"erase-tune: terminated by {signal.Signals(signum).name}"


def _say(line: str) -> None:
    """Write a line to standard error from the watcher thread: straight to the descriptor, past
    Python's stream and its lock, which the main thread may hold where the signal found it."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "backslashreplace"))


class _Watcher:
    """Reads the signal numbers the interpreter writes to the wakeup pipe, on its own thread."""

    def __init__(self, stop_limit_s: float) -> None:
        self._stop_limit_s = stop_limit_s
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        os.set_blocking(self._read, False)  # read by this thread and, for a moment, the main one (hear)
        self._lock = threading.Lock()
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._first: threading.Timer | None = None
        self._limit: threading.Timer | None = None
        self._thread = threading.Thread(target=self._run, name="erase-tune-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ready = select.poll()  # not select(): a descriptor past 1023 (a process with many files open)
        ready.register(self._read, select.POLLIN)
        while True:
            try:
                ready.poll()
            except OSError:
                return
            if not self.hear():  # the write end was closed: the command is over
                return

    def hear(self) -> bool:
        """Read what signals the interpreter has written to the pipe and act on them; False at its
        end. The main thread calls it too, to learn of a signal whose byte the watcher thread has
        not read yet (a library's handler raised at once, in place of ours)."""
        with self._lock:
            try:
                data = os.read(self._read, 64)
            except BlockingIOError:
                return True
            except OSError:
                return False
            for signum in data:
                if signum not in _HANDLED or _was_resent():
                    continue
                if self._first is None:  # the first signal: its handler raises where the command stands
                    _heard.append(signum)
                    self._first = threading.Timer(SAY_AFTER_S, self._still_running, args=(signum,))
                    self._limit = threading.Timer(self._stop_limit_s, self._out_of_time, args=(signum,))
                    for timer in (self._first, self._limit):
                        timer.daemon = True
                        timer.start()
                else:
                    self._exit_now(signum)
            return bool(data)

    @staticmethod
    def _still_running(signum: int) -> None:
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        waits = "stopping" if received else "stopping once the running computation returns"
        _say(f"{what} received: {waits} (send it again to end at once, skipping the clean-up)")

    @staticmethod
    def _exit_now(signum: int) -> None:
        _say(_stopped_line(signum) + " (at once: a second signal)")
        os._exit(128 + signum)

    def _out_of_time(self, signum: int) -> None:
        _say(f"{_stopped_line(signum)} (at once: still stopping {self._stop_limit_s:g}s after the signal, "
             f"{_main_thread_at()}; its clean-up was cut short, see ${STOP_ENV})")
        os._exit(128 + signum)

    def close(self) -> None:
        self.hear()
        for timer in (self._first, self._limit):
            if timer is not None:
                timer.cancel()
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)  # the thread reads EOF and ends
        self._thread.join(timeout=1)
        with contextlib.suppress(OSError):
            os.close(self._read)


def _main_thread_at() -> str:
    """Where the main thread stands, as ``in module.function``: the innermost Python frame (a
    call into C shows as its caller)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "in no Python code"
    return f"in {frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


def on_signals() -> Callable[[], None]:
    """Install the handlers (and the watcher) for one command; returns what puts the previous
    ones back (``main`` may be called in-process). Only the main thread can do this.

    The watcher starts first and the handlers last, so a signal that arrives while this runs
    (the test suite sends one the moment SIGTERM is caught) raises only after there is
    something to stop; if it raises in here, what was installed is put back before it goes on
    to the caller, whose ``try`` ends the command as any other signal would."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    stop_limit_s = env_stop_limit_s()
    received.clear()
    _heard.clear()
    old: dict[int, Any] = {}
    watcher: list[_Watcher] = []

    hook: list[Callable[[Any], Any]] = []

    def restore() -> None:
        while hook:
            sys.unraisablehook = hook.pop()
        while watcher:
            done = watcher.pop()
            done.close()
            _watching.remove(done)
        while old:
            sig, handler = old.popitem()
            signal.signal(sig, handler)

    # a signal the caller ignores stays ignored (`nohup` ignores SIGHUP, `cmd &` SIGINT)
    ours = [(sig, handler) for sig, handler in ((signal.SIGTERM, terminate), (signal.SIGHUP, terminate),
                                                (signal.SIGINT, _interrupt))
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)]
    try:
        if ours:
            watcher.append(_Watcher(stop_limit_s))
            _watching.append(watcher[-1])
            hook.append(sys.unraisablehook)
            sys.unraisablehook = _unraisable(hook[0])
        for sig, handler in ours:
            old[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
    except BaseException:
        restore()
        raise
    return restore


def sigterm_kept() -> Callable[[], None]:
    """What puts this command's SIGTERM handler back once Ray is up: ray.init installs one of its
    own, which exits without cancelling anything. SIGTERM (timeout, Kubernetes, ``ray job stop``)
    then ends the command as Ctrl-C does (``start``: trials cancelled and failed, the job marked
    interrupted), exit 143 with one line. A handler that is no function (SIGTERM ignored) becomes ours."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    handler = signal.getsignal(signal.SIGTERM)
    kept = handler if callable(handler) else terminate

    def put_back() -> None:
        signal.signal(signal.SIGTERM, kept)

    return put_back


_stuck: list[str] = []
"""Threads left inside a C library that will not return (what each waits for)."""


def stuck_thread(what: str) -> None:
    """Say that a thread was given up inside a C library (Ray waiting for processes that were
    stopped with this one): the interpreter's own exit would wait for it, or crash in it, so
    the command ends with ``os._exit`` once it has said its last line."""
    _stuck.append(what)


def exit_now(code: int) -> None:
    """End the process now with ``code`` if a thread was given up (:func:`stuck_thread`) or a signal
    stopped the command; else return. A stopped command has done its own clean-up, and the
    interpreter's exit would run other libraries' hooks, which wait on what the same signal may
    have stopped (Ray's ``shutdown``: a minute for its GCS, then exit 1). A private local Ray's
    processes are reaped by their own watchdog (erase_tune.tune.execute.reaper)."""
    if not _stuck and first_signal() is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
