"""The ``erase-tune`` command line: a table of commands, each a thin call into the library.

Parsing happens here; the work happens in library functions. Errors are one line,
``erase-tune: error: ...``, never a traceback: exit 2 for anything the user gave wrong
(bad plan, space, workload, storage URL, arguments), 1 for a job or export that ran and
did not get what was asked (every trial failed; no confirmed gain), 3 when the storage was
lost mid-job (outcomes not yet stored are kept in a local journal for the next ``start``),
130 when interrupted (Ctrl-C), 143 on SIGTERM and 129 on SIGHUP, with one line; an
environment variable that does not parse is exit 2 like a bad option (:mod:`erase_tune._env`).
``-v``/``-q`` set the level of the standard ``logging`` module, where progress goes
(stderr); results go to stdout (``--json`` for machines).

What a command changes in the process itself is decided here, never in the library: the
signal handlers (SIGTERM's is put back after ray.init replaces it, in ``start`` and
``export``) and the import path (the current directory; what ``start`` ships to the workers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from erase_tune import __version__
from erase_tune._env import check_environment
from erase_tune._signals import exit_now, first_signal, on_signals, received, sigterm_kept, stopped
from erase_tune.cli_args import (
    Parser,
    bench_args,
    check_args,
    dashboard_args,
    db_args,
    export_args,
    report_args,
    start_args,
    status_args,
    trial_args,
)
from erase_tune.errors import EraseTuneError, Terminated, one_line

__all__ = ["main", "build_parser"]

log = logging.getLogger("erase_tune")


def _budget(ns: argparse.Namespace) -> Any:
    from erase_tune.measure.records import Budget

    return Budget(warmup_steps=ns.warmup, windows=ns.windows, window_steps=ns.window_steps,
                  quality_steps=getattr(ns, "quality_steps", 0), seed=ns.seed)


def _emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _check_output_dir(path: str, storage: str | None, *, names: Any) -> None:
    """An output directory and the files a command writes in it: never the study's own
    storage, a device or a plain file (checked before the storage is opened)."""
    from pathlib import Path

    from erase_tune._files import check_output
    from erase_tune.store.engine import storage_files

    protect = storage_files(storage)
    check_output(path, flag="-o", protect=protect, directory=True)
    if Path(path).is_dir():
        for name in names:
            check_output(Path(path) / name, flag="-o", protect=protect)


# -- commands ------------------------------------------------------------------------------


def cmd_trial(ns: argparse.Namespace) -> int:
    from erase_tune.errors import PlanError
    from erase_tune.runtime import ErasePlan
    from erase_tune.measure.noise import measure_noise_floor
    from erase_tune.measure.trial import run_trial
    from erase_tune.tune.views.tables import trial_table
    from erase_tune.workloads import get_workload, workload_args

    budget, repeats = _budget(ns), _noise_repeats(ns)
    plan = ErasePlan.load(ns.plan)
    workload = get_workload(ns.workload, workload_args(ns.arg))
    try:  # the plan may not fit this model: name the file
        result = run_trial(workload, plan, budget, device=ns.device)
    except PlanError as e:
        raise PlanError(f"{ns.plan}: {e}") from None
    floor = measure_noise_floor(workload, budget, repeats=repeats, device=ns.device) if repeats else None
    if ns.json:
        _emit_json({**result.to_dict(), "noise_floor": None if floor is None else floor.to_dict()})
    else:
        print(trial_table(result, floor))
    return 0


def _noise_repeats(ns: argparse.Namespace) -> int:
    """``--noise-floor N``, refused before anything is trained, not after the trial."""
    from erase_tune.measure.records import MAX_REPEATS

    if not 0 <= ns.noise_floor <= MAX_REPEATS:
        raise EraseTuneError(f"--noise-floor: {ns.noise_floor} must be in 0..{MAX_REPEATS} (0: not measured)")
    return ns.noise_floor


def cmd_bench(ns: argparse.Namespace) -> int:
    from erase_tune.measure.bench import run_bench
    from erase_tune.measure.noise import measure_noise_floor
    from erase_tune.tune.views.tables import noise_line
    from erase_tune.workloads import get_workload, workload_args

    if ns.trace is not None:
        from erase_tune._files import check_output

        check_output(ns.trace, flag="--trace", directory=True)
    budget, repeats = _budget(ns), _noise_repeats(ns)
    workload = get_workload(ns.workload, workload_args(ns.arg))
    cuts = [c for c in ns.cuts.split(",") if c] if ns.cuts else None
    only = [c.strip() for c in ns.only.split(",") if c.strip()] if ns.only else None
    result = run_bench(workload, budget=budget, device=ns.device, cuts=cuts, streams=ns.streams,
                       trace_dir=ns.trace, only=only)
    floor = measure_noise_floor(workload, budget, repeats=repeats, device=ns.device) if repeats else None
    if ns.json:
        _emit_json({**result.to_dict(), **({"noise_floor": floor.to_dict()} if floor is not None else {})})
        return 0
    prov = result.provenance
    print(f"workload {result.workload} (batch {result.batch_size}) on {prov['device_name']}, "
          f"torch {prov['torch']}, cuda {prov['cuda']}; cuts {', '.join(prov['cuts'])}; {prov['streams']} streams")
    for candidate, why in result.left_out:
        print(f"not cut: {candidate}: {why}")
    if result.graph_error is not None:
        print(f"graph rows left out: the whole step cannot be captured as one CUDA graph: {result.graph_error}")
    for row, why in result.skipped:
        print(f"skipped {row}: {why}")
    print(result.table())
    if result.host_table():
        print(f"\n{result.host_table()}")
    if floor is not None:
        print(noise_line(floor))
    return 0


def cmd_check(ns: argparse.Namespace) -> int:
    """A dry run of a space: checked against its model, its single elements tried, its step timed."""
    from erase_tune.tune.run.check import check_space_file

    found = check_space_file(ns.space, trials=ns.trials, slots=ns.slots, import_from=_import_from)
    _emit_json(found.to_dict()) if ns.json else print(found.text())
    return 0


def cmd_start(ns: argparse.Namespace) -> int:
    from erase_tune.tune.run.job import DriverHooks, JobSpec, Patience, Where, start_job
    from erase_tune.tune.views.tables import progress_line, start_summary

    if ns.repeats == 0 and not ns.no_confirm:  # JobSpec takes 0 for "no confirmation": say how to ask for that
        from erase_tune.measure.records import MAX_CONFIRM_WINDOWS

        raise EraseTuneError(f"--repeats: 0 must be an integer in 2..{MAX_CONFIRM_WINDOWS} (an interval needs two "
                             "windows); --no-confirm skips the confirmation")
    summary = start_job(
        ns.space,
        what=JobSpec(study_name=ns.study, trials=ns.trials, confirm_windows=0 if ns.no_confirm else ns.repeats,
                     quality_scale=ns.quality_scale, quality_seeds=ns.quality_seeds, time_budget_s=ns.time_budget),
        where=Where(storage=ns.storage, ray_address=ns.ray_address, slots=ns.slots, working_dir=ns.working_dir,
                    py_modules=ns.py_module),
        patience=Patience(gpu_wait_s=ns.gpu_wait, grace_period_s=ns.grace_period),
        on_progress=lambda p: log.info(progress_line(p)),
        driver=DriverHooks(import_from=_import_from, ray_started=sigterm_kept()))
    flag = f" --storage {shlex.quote(summary.storage)}"
    if ns.json:
        _emit_json({**dataclasses.asdict(summary),
                    "next": [f"erase-tune status --study {summary.study_name}{flag}",
                             f"erase-tune export --study {summary.study_name}{flag} -o best.yaml"]})
        return 0
    print(start_summary(summary))
    print(f"next: erase-tune status --study {summary.study_name}{flag}")
    print(f"      erase-tune export --study {summary.study_name}{flag} -o best.yaml")
    return 0


def _import_from(dirs: Sequence[str]) -> None:
    """``start``'s driver imports the workload too (to check the space): from where it is shipped."""
    for d in dirs:
        if d not in sys.path:
            sys.path.insert(0, d)


def cmd_status(ns: argparse.Namespace) -> int:
    from erase_tune.tune.views.status import job_status, list_jobs, trial_detail

    if ns.trial is not None:
        detail = trial_detail(ns.storage, ns.study, ns.trial)
        _emit_json(dataclasses.asdict(detail)) if ns.json else print(detail.table())
        return 0
    if ns.study is None:
        jobs = list_jobs(ns.storage)
        if len(jobs) > 1:
            if ns.json:
                _emit_json([dataclasses.asdict(j) for j in jobs])
            else:
                for j in jobs:
                    print(f"{j.study_name}: {j.status}, target {j.n_trials_target} trials, workload {j.workload}")
            return 0
    status = job_status(ns.storage, ns.study)
    _emit_json(dataclasses.asdict(status)) if ns.json else print(status.table())
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from erase_tune.tune.views.export import ConfirmSettings, export_plan
    from erase_tune.tune.run.remote import confirming_executor

    factory = confirming_executor(ns.ray_address, ns.working_dir, ns.py_module, on_ray_started=sigterm_kept())
    confirm = ConfirmSettings(windows=ns.repeats, quality_scale=ns.quality_scale, quality_seeds=ns.quality_seeds)
    done = export_plan(ns.storage, ns.study, ns.output, max_ne_gap=ns.max_ne_gap, pick=ns.pick, force=ns.force,
                       executor_factory=factory, confirm=confirm)
    p, c = done.point, done.confirmation
    if ns.json:
        _emit_json({"output": ns.output, "trial": p.number, "search_qps_gain": p.qps_gain, "ne_gap": p.ne_gap,
                    "confirmed": None if c is None else {"gain": c.gain, "lo": c.gain_lo, "hi": c.gain_hi,
                                                         "windows": c.windows},
                    "plan": done.plan.to_dict()})
        return 0
    print(f"wrote {ns.output}: trial {p.number}, search QPS gain {p.qps_gain:+.2%}, NE gap {p.ne_gap:+.2%}")
    if c is not None:
        print(f"confirmed gain {c.gain:+.2%} [95% interval {c.gain_lo:+.2%}, {c.gain_hi:+.2%}] over {c.windows} windows"
              + ("" if c.gain_lo > 0 else "  (NOT a confirmed gain: written because of --force)"))
    q = done.plan.provenance
    if q.get("exact"):
        print("NE gap 0: exact (its gradients were checked equal to the baseline's; not trained for NE)")
    elif "confirmed_ne_gap" in q:
        print(f"confirmed NE gap {q['confirmed_ne_gap']:+.2%} [95% interval {q['confirmed_ne_gap_lo']:+.2%}, "
              f"{q['confirmed_ne_gap_hi']:+.2%}] over {q['confirmed_ne_seeds']} seeds of {q['confirmed_ne_steps']} "
              f"steps; noise floor ±{q['ne_noise_band']:.2%}" + ("" if q.get("quality_confirmed") else
                                                                "  (ABOVE the NE budget beyond the noise: written "
                                                                "because of --force)"))
    print(f"plan: {done.plan.describe()}")
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from erase_tune.tune.views.html_report import _FILES, report

    _check_output_dir(ns.output, ns.storage, names=_FILES.values())
    files = report(ns.storage, ns.study, ns.output)
    print(f"wrote {files.html}" + "".join(f"\n      {png}" for png in files.pngs))
    return 0


def cmd_dashboard(ns: argparse.Namespace) -> int:
    from erase_tune.tune.views.dashboard import serve

    serve(ns.storage, host=ns.host, port=ns.port)
    return 0


def cmd_db(ns: argparse.Namespace) -> int:
    from erase_tune.store import default_storage_url
    from erase_tune.store.storage import open_storage

    db = open_storage(ns.storage if ns.storage is not None else default_storage_url(),
                      must_exist=ns.action == "current", upgrade=ns.action == "upgrade")
    try:
        print(f"{db.url}: schema at revision {db.store.schema_version().revision}")
    finally:
        db.close()
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "trial": ("measure one plan against the baseline", trial_args, cmd_trial),
    "bench": ("time the runtime's variants side by side", bench_args, cmd_bench),
    "check": ("dry run of a search space: its plans, what the model refuses, step time, estimate (trains "
              "nothing)", check_args, cmd_check),
    "start": ("run (or resume) a tuning job", start_args, cmd_start),
    "status": ("a job, its Pareto front and confirmations; or one trial", status_args, cmd_status),
    "export": ("confirm the front and write the chosen plan file for production", export_args, cmd_export),
    "report": ("write an HTML report with figures of a study", report_args, cmd_report),
    "dashboard": ("serve optuna-dashboard on the job storage", dashboard_args, cmd_dashboard),
    "db": ("database schema: upgrade or show the current revision", db_args, cmd_db),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="erase-tune", description="Autotune ERASE detachment placement.")
    parser.add_argument("--version", action="version", version=f"erase-tune {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="errors and results only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, (help_text, add_args, func) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=func)
    return parser


def _not_an_interruption(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def _configure_logging(ns: argparse.Namespace) -> None:
    level = logging.WARNING if ns.quiet else (logging.DEBUG if ns.verbose > 1 else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    # A library that logs what it caught before raising it again (SQLAlchemy's pool, a signal
    # arriving while it closes a connection) would print the interruption as a traceback: the
    # command reports it once, in its own line. Anything else it logs is shown as before.
    library = logging.StreamHandler(sys.stderr)
    library.addFilter(_not_an_interruption)
    sql = logging.getLogger("sqlalchemy")
    sql.handlers[:] = [library]
    sql.propagate = False
    if ns.command in ("start", "status", "export", "dashboard", "report"):
        import warnings

        import optuna

        # Optuna's per-trial INFO lines and experimental-API warnings would drown the progress;
        # its heartbeat is used with ask/tell on purpose (the driver beats for its trials).
        optuna.logging.set_verbosity(optuna.logging.DEBUG if ns.verbose > 1 else optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


_SERVICE_MODULES = {"optuna", "optuna_dashboard", "ray", "sqlalchemy", "alembic", "psycopg", "psutil", "matplotlib"}
"""What ``erase-tune[tune]`` adds to the runtime-only install."""


def _printable_output() -> None:
    """Characters the terminal's encoding lacks (``PYTHONIOENCODING=ascii`` and a study named
    ``étude``) are written as escapes instead of ending the command in a traceback."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EPIPE, errno.EROFS})


def _output_failed(e: OSError) -> str | None:
    """One line for a write that failed for want of room (a full disk under ``status --json >
    file``, ``report -o``, ``bench --trace``), "" for a reader that went away (``| head``: silent,
    as any Unix tool), else None. Standard output's descriptor is then pointed at /dev/null, so
    that the exit's own flush of what is still buffered cannot fail a second time."""
    if e.errno not in _OUTPUT_ERRNOS:
        return None
    if e.filename is None:  # a stream's write: standard output, most likely
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if e.errno == errno.EPIPE:
        return ""
    where = one_line(str(e.filename), 200) if e.filename is not None else "the command's output"
    return f"cannot write {where}: {e.strerror or os.strerror(e.errno or 0)} (free some space or write elsewhere)"


def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    if argv is None:  # the process's own command (not a caller in-process): nothing may hold its exit
        exit_now(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    _printable_output()
    restore: Callable[[], None] = lambda: None  # noqa: E731 - a signal may arrive while on_signals installs
    ns = None
    try:
        restore = on_signals()
        try:
            ns = build_parser().parse_args(argv)
        except SystemExit as e:
            if not e.code:  # --help, --version: a full disk shows here, not as a silent exit 0
                sys.stdout.flush()
            raise
        # As `python -m` does: a user's `package.module:factory` next to where the command runs
        # imports without installing it (the console script alone would not look there).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        check_environment()
        _configure_logging(ns)
        code = ns.func(ns)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not in the exit's own flush
        return stopped(received[0]) if received else code
    except OSError as e:
        message = _output_failed(e)
        if message is None:
            return _failed_while_stopping(e)
        if not message:
            return 128 + signal.SIGPIPE
        print(f"erase-tune: error: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _SERVICE_MODULES:
            raise
        print(f"erase-tune: error: `erase-tune {ns.command if ns else ''}` needs the tuning service, and {e.name} is "
              "not installed: pip install 'erase-tune[tune]'", file=sys.stderr)
        return 2
    except EraseTuneError as e:
        if (signum := first_signal()) is not None:  # what failed was stopped by the signal: say that, once
            return stopped(signum)
        print(f"erase-tune: error: {one_line(e, squeeze=True)}", file=sys.stderr)
        return int(getattr(e, "exit_code", 2))
    except Terminated as e:
        return stopped(e.signum)
    except KeyboardInterrupt:  # a library may have turned our Terminated into a plain one
        return stopped(received[0] if received else signal.SIGINT)
    except SystemExit:
        if (signum := first_signal()) is None:
            raise
        return stopped(signum)  # a library's handler in place of ours (Ray's for SIGTERM: sys.exit)
    except Exception as e:  # noqa: BLE001 - raised again unless a signal stopped the command
        return _failed_while_stopping(e)
    finally:
        restore()


def _failed_while_stopping(e: Exception) -> int:
    """A signal's exit code and line when the command's clean-up after it failed (Ray stopped by
    the same signal): the failure is said in a line of its own, not as what ended the command.
    Raises ``e`` again when no signal came."""
    signum = first_signal()
    if signum is None:
        raise e
    print(f"erase-tune: while stopping: {one_line(e, 300)}", file=sys.stderr)
    return stopped(signum)


if __name__ == "__main__":
    sys.exit(main())
