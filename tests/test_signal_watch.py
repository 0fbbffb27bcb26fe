"""A workload factory that will not stop: Ctrl-C is still heard.

The first signal raises where the command stands. A factory may catch that and carry on, or
sit in one long call into C, where Python cannot run a handler at all. Either way the command
says within a few seconds what it waits for, and a second signal ends it at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STARTED = '''
import hashlib, pathlib, sys, threading, time

def _started():
    pathlib.Path("started").write_text("yes")

def _started_once_in_c(line):
    """Say "started" once the main thread has sat on the line of its long C call for a while (it
    releases the GIL there): said before the call, a signal could still land in Python code on
    the way to it, and the command would have been stopped by the first signal after all."""
    main = threading.main_thread().ident
    def watch():
        on_line = 0
        while on_line < 5:
            time.sleep(0.05)
            frame = sys._current_frames().get(main)
            on_line = on_line + 1 if frame is not None and frame.f_lineno == line else 0
        _started()
    threading.Thread(target=watch, daemon=True).start()
'''
"""What a script run by these tests says "started" with, for the test to send its signal then."""

FACTORIES = STARTED + '''

def swallows():
    _started()
    while True:
        try:
            time.sleep(0.05)
        except BaseException:  # a factory that eats Ctrl-C
            pass

def stuck_in_c():
    _started_once_in_c(sys._getframe().f_lineno + 1)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**9)  # minutes in one call into C
'''


def _catches(pid: int, sig: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _wait_for(what: str, ok, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        assert proc.poll() is None, f"ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit:.0f}s"
        time.sleep(0.05)


@pytest.mark.parametrize(("factory", "says"), [
    ("swallows", "Ctrl-C received: stopping (send it again"),
    ("stuck_in_c", "Ctrl-C received: stopping once the running computation returns"),
])
def test_a_factory_that_does_not_stop_is_ended_by_a_second_ctrl_c(tmp_path, factory, says):
    (tmp_path / "stubborn.py").write_text(FACTORIES)
    (tmp_path / "plan.yaml").write_text("cuts: []\n")
    proc = subprocess.Popen([sys.executable, "-m", "erase_tune", "trial", "--workload", f"stubborn:{factory}",
                             "--plan", "plan.yaml"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        _wait_for("factory start", (tmp_path / "started").exists, proc)
        _wait_for("signal handlers", lambda: _catches(proc.pid, signal.SIGTERM), proc)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        # 2 s after the signal the note is due; allow a loaded machine its scheduling delay
        _wait_for("note of what it waits for", lambda: any(says in line for line in list(lines)), proc, limit=30)
        assert time.monotonic() - sent >= 1.5, "the note came before its time: " + "".join(lines)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines)
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("erase-tune:")] == \
        ["erase-tune: interrupted (at once: a second signal)"], err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_handlers_are_being_installed_ends_the_command_in_one_line(sig):
    """The moment a handler is in place a signal may arrive (a supervisor that sends SIGTERM as
    soon as the process catches it): it ends the command as any other signal, 128+N and one line,
    not with a traceback from the set-up that was still running."""
    code = f'''
import os, signal, sys
import erase_tune._signals as s
original = signal.signal
def install(signum, handler):
    previous = original(signum, handler)
    if signum == {int(sig)} and handler in (s.terminate, s._interrupt):
        os.kill(os.getpid(), {int(sig)})  # arrives before on_signals returns
    return previous
signal.signal = install
from erase_tune.cli import main
sys.exit(main(["--help"]))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 128 + sig, out.stderr
    assert out.stderr.strip().splitlines() == [
        "erase-tune: interrupted" if sig == signal.SIGINT else "erase-tune: terminated by SIGTERM"], out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_signals_deferred_is_raised_once_the_block_has_run(sig):
    """A few storage writes must not be cut in half (Optuna's ask() creates a RUNNING trial
    before it returns its number): a signal in the block is raised as it ends, in place of
    what the block raised, and only once."""
    from erase_tune import _signals
    from erase_tune.errors import Terminated

    before = signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    restore = _signals.on_signals()  # (installs its handlers over the defaults only: a Ray in this process sets its own)
    try:
        ran = []
        with pytest.raises(KeyboardInterrupt) as caught:
            with _signals.signals_deferred():
                os.kill(os.getpid(), sig)
                time.sleep(0.2)  # the handler has run by now, and raised nothing
                ran.append("the rest of the block")
                raise ValueError("what the block raised")
        assert ran == ["the rest of the block"]
        assert isinstance(caught.value, Terminated) == (sig == signal.SIGTERM)
        with _signals.signals_deferred():  # nothing left pending
            pass
    finally:
        restore()
        signal.signal(sig, before)


def test_a_signal_a_library_logs_before_raising_it_again_is_not_shown_as_a_traceback():
    """SQLAlchemy's pool logs "Exception closing connection" with its traceback before it
    raises a signal's exception again (seen: SIGTERM while a SQLite connection closed): the
    command reports the signal in its own line only. Its other errors are still shown."""
    code = '''
import logging, sys
from erase_tune.cli import _configure_logging, build_parser
from erase_tune.errors import Terminated
_configure_logging(build_parser().parse_args(["status"]))
pool = logging.getLogger("sqlalchemy.pool.impl.NullPool")
for exc in (Terminated(15), KeyboardInterrupt(), OSError("disk I/O error")):
    try:
        raise exc
    except BaseException:
        pool.error("Exception closing connection %r", "conn", exc_info=True)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Exception closing connection") == 1 and "disk I/O error" in out.stderr, out.stderr
    assert "Terminated" not in out.stderr and "KeyboardInterrupt" not in out.stderr, out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_lands_in_a_finalizer_still_ends_the_command(sig):
    """The handler raises where the main thread stands, and that may be inside a finalizer or a
    weakref callback the garbage collector runs, where Python cannot raise: it printed "Exception
    ignored in" with a traceback and went on, and the dashboard served on after SIGTERM (seen in
    the hostile-signals test). The signal is sent again once that code has returned: the command
    ends with 128+N and one line, and the watcher does not take the second sending for a second
    signal (which would end the process at once, without its clean-up)."""
    code = f'''
import os, signal, sys, time
from erase_tune.cli import main
import erase_tune.cli as cli

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), {int(sig)})
        for _ in range(100_000):  # the handler runs in here, inside the finalizer
            pass

def command(ns):
    Finalized()  # dropped at once: its finalizer runs, the signal's exception is swallowed there
    time.sleep(10)  # what the command does next: a signal that is not lost ends this
    print("the signal was lost", file=sys.stderr)
    return 0

cli.cmd_db = command
cli.COMMANDS["db"] = (*cli.COMMANDS["db"][:2], command)
sys.exit(main(["db", "current", "--storage", "sqlite:///nowhere.db"]))
'''
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 128 + sig, out.stderr
    assert out.stderr.strip().splitlines() == [
        "erase-tune: interrupted" if sig == signal.SIGINT else "erase-tune: terminated by SIGTERM"], out.stderr
    assert time.monotonic() - started < 10


STOPPING = STARTED + '''
import atexit, signal
import erase_tune.cli as cli

def exit_hook(ns):
    atexit.register(time.sleep, 600)  # as Ray's shutdown waits on a GCS the same signal stopped
    _started()
    time.sleep(600)

def foreign_handler(ns):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init installs
    _started()
    time.sleep(600)

def cleanup_fails(ns):
    try:
        _started()
        time.sleep(600)
    finally:
        raise ConnectionError("the raylet is gone")  # Ray stopped by the same signal

def stuck_in_c(ns):
    _started_once_in_c(sys._getframe().f_lineno + 1)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**9)  # minutes in one call into C, as Ray waiting on its GCS

command = globals()[sys.argv[1]]
cli.cmd_db = command
cli.COMMANDS["db"] = (*cli.COMMANDS["db"][:2], command)
sys.argv = ["erase-tune", "db", "current", "--storage", "sqlite:///nowhere.db"]
sys.exit(cli.main())
'''


@pytest.mark.parametrize(("case", "lines"), [
    ("exit_hook", ["erase-tune: terminated by SIGTERM"]),
    ("foreign_handler", ["erase-tune: terminated by SIGTERM"]),
    ("cleanup_fails", ["erase-tune: while stopping: the raylet is gone", "erase-tune: terminated by SIGTERM"]),
    ("stuck_in_c", ["erase-tune: terminated by SIGTERM (at once: still stopping 3s after the signal, in "
                    "__main__.stuck_in_c; its clean-up was cut short, see $ERASE_TUNE_STOP_LIMIT_S)"]),
])
def test_sigterm_ends_the_command_within_its_stop_limit_whatever_holds_it(tmp_path, case, lines):
    """SIGTERM to a whole process group stops the local Ray with the driver, and Ray then holds
    the driver in several ways (seen: exit 1 a minute later, with no line): its exit hook waits
    for the GCS, its own SIGTERM handler exits in place of ours, a clean-up call fails, or the main
    thread sits in a call that never returns. Each ends within the stop limit: 143 and one line."""
    (tmp_path / "stopping.py").write_text(STOPPING)
    proc = subprocess.Popen([sys.executable, "stopping.py", case], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_STOP_LIMIT_S": "3"})
    try:
        _wait_for("the command's start", (tmp_path / "started").exists, proc)
        _wait_for("signal handlers", lambda: _catches(proc.pid, signal.SIGTERM), proc)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert proc.wait(timeout=60) == 143, proc.stderr.read()
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert [line for line in err.splitlines() if line.startswith("erase-tune:")] == lines, err
    assert "Traceback" not in err, err
    assert took < (30 if case == "stuck_in_c" else 20), f"{took:.0f}s"
