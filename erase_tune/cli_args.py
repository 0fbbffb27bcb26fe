"""The ``erase-tune`` command line's options, one function per command (:mod:`erase_tune.cli`
holds the commands themselves). A usage error is one line and exit 2, like every other."""

from __future__ import annotations

import argparse
import sys
from typing import IO, NoReturn

from erase_tune.errors import one_line

__all__ = ["Parser", "trial_args", "bench_args", "check_args", "start_args", "status_args", "export_args",
           "report_args", "dashboard_args", "db_args"]

MAX_USAGE_MESSAGE = 300
"""Longest usage error argparse may print (it quotes the refused value whole)."""


class Parser(argparse.ArgumentParser):
    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        # argparse ignores a write that fails: --help onto a full disk ended in exit 0, its text lost.
        if message:
            (file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's own prints usage too)
        # argparse quotes the value it refused in full: a 5000-digit --trials would fill the screen.
        message = one_line(message, squeeze=True)
        if len(message) > MAX_USAGE_MESSAGE:
            message = message[: MAX_USAGE_MESSAGE - 1] + "…"
        self.exit(2, f"erase-tune: error: {message} (see: {self.prog} --help)\n")


# -- options -----------------------------------------------------------------------------

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_arg(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1.5h``, ``1d``: seconds (argparse turns a ValueError into one line)."""
    t = text.strip().lower()
    unit = _UNITS.get(t[-1:], None) if t else None
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 10m, 1h)") from None
    if not 1 <= value <= 7 * 86400:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} must be between 1s and 7d")
    return value



def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="ctr, gpt, mlp, dlrm, or package.module:factory")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="workload argument (repeatable)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_budget(p: argparse.ArgumentParser, quality: bool = True) -> None:
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per variant (default 8)")
    p.add_argument("--windows", type=int, default=4, help="alternating timing windows (default 4)")
    p.add_argument("--window-steps", type=int, default=10, help="timed steps per window (default 10)")
    if quality:
        p.add_argument("--quality-steps", type=int, default=0, help="extra training steps before NE (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-floor", type=int, default=0, metavar="N",
                   help="also measure the NE gap's noise floor: the baseline against itself over N other data orders "
                        "(and the whole-step graph on CUDA); default 0: not measured")


def trial_args(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--plan", required=True, help="plan file (YAML)")
    _add_budget(p)


def bench_args(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--cuts", help="comma-separated cut targets (default: the workload's candidates)")
    p.add_argument("--streams", type=int, default=4, help="side streams for the ERASE variants (default 4)")
    p.add_argument("--trace", metavar="DIR", help="also profile the ERASE variants and report stream overlap")
    p.add_argument("--only", help="comma-separated variant names to run (baselines always run)")
    _add_budget(p, quality=False)


def _storage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", help="SQLAlchemy URL (default: $ERASE_TUNE_STORAGE, else sqlite:///erase-tune.db; "
                                     "postgresql+psycopg://user@host/db for several drivers or machines)")


def _given(value: str) -> str:
    """A value that, empty, would silently mean "not given" (a private local Ray for
    ``--ray-address``, the space's own directory for ``--working-dir``)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave the option out for its default)")
    return value


def _ray(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", type=_given, help="Ray cluster to join (auto, host:port, ray://...; default: "
                                                      "$RAY_ADDRESS, else a private local Ray)")
    p.add_argument("--working-dir", type=_given,
                   help="directory shipped to the Ray workers (Ray runtime_env working_dir)")
    p.add_argument("--py-module", type=_given, action="append", default=[], metavar="PATH",
                   help="package directory shipped to the Ray workers (runtime_env py_modules; repeatable)")


def _quality(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quality-scale", type=int, metavar="N",
                   help="quality confirmation trains finalists N times a trial's steps (default: the space's "
                        "budget.quality_scale, 1 unless set; 0: no quality confirmation)")
    p.add_argument("--quality-seeds", type=int, metavar="N",
                   help="data orders of the quality confirmation (default: the space's budget.quality_seeds, 3)")


def check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", required=True, help="search space file (search_spaces/*.yaml)")
    p.add_argument("--trials", type=int, help="trials the estimate is for (default: the space's)")
    p.add_argument("--slots", type=int, help="trials in flight the estimate assumes (default: as start on this "
                                             "machine: one per GPU, else one per CPU; never more than the trials)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def start_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", required=True, help="search space file (search_spaces/*.yaml)")
    p.add_argument("--study", help="study name (default: the space file's name); an existing study is resumed")
    p.add_argument("--trials", type=int, help="measured trials the study should hold when done (default: the space's)")
    _storage(p)
    _ray(p)
    p.add_argument("--slots", type=int, help="trials in flight (default: one per GPU, else one per CPU; never more "
                                             "than the trials)")
    p.add_argument("--gpu-wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for GPUs to join the cluster before giving up (default 600)")
    p.add_argument("--grace-period", type=int, default=60, metavar="SECONDS",
                   help="a running trial whose driver sent no heartbeat for this long is failed (default 60)")
    p.add_argument("--repeats", type=int, default=5, metavar="K",
                   help="least windows of the confirming re-measurement of the front at the end (default 5; each "
                        "plan is measured until its gain is known to ±2%% or 40 windows)")
    p.add_argument("--no-confirm", action="store_true", help="skip the confirmation at the end")
    p.add_argument("--time-budget", type=duration_arg, metavar="DURATION",
                   help="bound the whole job, confirmation included (e.g. 90s, 10m, 1h): no trial starts that "
                        "would end past it, and the confirmation takes what is left")
    _quality(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="study name (default: the only study in the storage; several: they are listed)")
    _storage(p)
    p.add_argument("--trial", type=int, help="show one trial: metrics, raw samples, failure traceback, provenance")
    p.add_argument("--json", action="store_true")


def export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True)
    _storage(p)
    p.add_argument("--max-ne-gap", type=float, help="NE-gap budget (default: the job's)")
    p.add_argument("--pick", default="max-gain", choices=["max-gain", "knee"])
    p.add_argument("--repeats", type=int, default=5, metavar="K",
                   help="least windows of the confirming re-measurement (default 5; an earlier one with >= K is "
                        "reused; each plan is measured until its gain is known to ±2%% or 40 windows)")
    p.add_argument("--force", action="store_true", help="write the best plan even if no gain (or no quality) is "
                                                        "confirmed")
    _quality(p)
    _ray(p)
    p.add_argument("-o", "--output", required=True, help="plan file to write")
    p.add_argument("--json", action="store_true")


def report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True)
    _storage(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for report.html and the PNGs")


def dashboard_args(p: argparse.ArgumentParser) -> None:
    _storage(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)


def db_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["upgrade", "current"])
    _storage(p)
