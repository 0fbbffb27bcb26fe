"""Process-global side effects (signal handlers, the import path) are decided in cli.py and its
signal module only (and in the benchmark runner's cases, which run as a process of their own).

The end-to-end behaviour (SIGTERM during ``erase-tune start`` ends the job as Ctrl-C does,
exit 143; the driver imports a workload shipped with ``--py-module``) is tested through real
processes in tests/tune/test_resume.py and tests/test_hostile_ops.py.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from erase_tune import _signals, cli
from erase_tune.tune.execute.executor import import_dirs
from erase_tune.tune.run.job import DriverHooks

PACKAGE = Path(cli.__file__).parent
EDITS = re.compile(r"signal\.(signal|set_wakeup_fd)\(|sys\.path\.(insert|append|extend|remove)\(|sys\.path\s*(\+)?=[^=]")


def test_only_the_cli_changes_signal_handlers_or_the_import_path():
    # The benchmark runner's cases run in a process of their own (python -m erase_tune.benchmarks),
    # as the CLI's commands do: a case may stop its ranks on a signal or import the tests' models.
    runner = PACKAGE / "benchmarks"
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{n}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 if path.name not in ("cli.py", "_signals.py") and runner not in path.parents
                 for n, line in enumerate(path.read_text().splitlines(), 1) if EDITS.search(line)]
    assert not offenders, offenders


def test_the_shipped_code_imports_from_each_py_modules_parent_then_the_working_dir():
    env = {"working_dir": "/w", "py_modules": ["/a/pkg", "/b/other", "/w"]}
    assert import_dirs(env) == ["/a", "/b", "/w", "/w"]
    assert import_dirs({}) == []
    assert import_dirs({"working_dir": "/w"}) == ["/w"]


def test_a_library_caller_gets_hooks_that_change_nothing():
    hooks = DriverHooks()
    before = signal.getsignal(signal.SIGTERM)
    hooks.ray_started()
    hooks.import_from(["/nowhere"])
    assert "/nowhere" not in sys.path and signal.getsignal(signal.SIGTERM) is before


def test_the_cli_puts_its_sigterm_handler_back_after_ray_replaces_it():
    def mine(signum, frame):  # the handler the command runs with
        raise AssertionError("not called")

    def rays(signum, frame):  # what ray.init installs
        raise AssertionError("not called")

    original = signal.signal(signal.SIGTERM, mine)
    try:
        put_back = _signals.sigterm_kept()
        signal.signal(signal.SIGTERM, rays)
        put_back()
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a handler that is no function: SIGTERM still ends it
        put_back = _signals.sigterm_kept()
        signal.signal(signal.SIGTERM, rays)
        put_back()
        assert signal.getsignal(signal.SIGTERM) is _signals.terminate
    finally:
        signal.signal(signal.SIGTERM, original)
