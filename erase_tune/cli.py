"""The ``erase-tune`` command line: a table of commands, each a thin call into the library.

Parsing happens here; the work happens in library functions. Any
:class:`~erase_tune.errors.EraseTuneError` (bad plan, unknown workload, bad space, storage
problem) is printed as one line, ``erase-tune: error: ...``, with exit code 2 — never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import yaml

from erase_tune.errors import EraseTuneError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's own prints usage too)
        self.exit(2, f"erase-tune: error: {message} (see: {self.prog} --help)\n")


def _workload_args(pairs: Sequence[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise EraseTuneError(f"--arg: {pair!r} is not KEY=VALUE")
        try:
            args[key] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            args[key] = value
    return args


def _budget(ns: argparse.Namespace):
    from erase_tune.trial import Budget

    return Budget(warmup_steps=ns.warmup, windows=ns.windows, window_steps=ns.window_steps,
                  quality_steps=getattr(ns, "quality_steps", 0), seed=ns.seed)


def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="ctr, gpt, mlp, or package.module:factory")
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


# -- commands ------------------------------------------------------------------------------


def cmd_trial(ns: argparse.Namespace) -> int:
    from erase_tune.errors import PlanError
    from erase_tune.runtime import ErasePlan
    from erase_tune.trial import run_trial
    from erase_tune.workloads import get_workload

    plan = ErasePlan.load(ns.plan)
    workload = get_workload(ns.workload, _workload_args(ns.arg))
    try:  # before any data is made, and naming the file: the plan may not fit this model
        plan.check_model(workload.build_model())
    except PlanError as e:
        raise PlanError(f"{ns.plan}: {e}") from None
    result = run_trial(workload, plan, _budget(ns), device=ns.device)
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    prov = result.provenance
    print(f"workload {result.workload} (batch {result.batch_size}) on {prov['device_name']}, torch {prov['torch']}")
    print(f"plan: {plan.describe()}")
    print(f"{'variant':<12} {'p90 QPS':>12} {'median QPS':>12} {'gain p90':>9} {'NE':>7}")
    base = result.variants["baseline"].p90_qps
    ne = {"baseline": result.ne_baseline, "candidate": result.ne_candidate}
    for name, v in result.variants.items():
        ne_s = f"{ne[name]:.4f}" if name in ne else "-"
        print(f"{name:<12} {v.p90_qps:>12,.0f} {v.median_qps:>12,.0f} {v.p90_qps / base - 1:>+9.1%} {ne_s:>7}")
    lo, hi = result.gain_spread
    print(f"gain p90 {result.gain_p90:+.2%} (median {result.gain_median:+.2%}, per window {lo:+.1%}..{hi:+.1%});"
          f" NE gap {result.ne_gap:+.2%}")
    if result.gain_detach_only is not None:
        print(f"of which work removed (detach only): {result.gain_detach_only:+.2%}")
    if result.gain_vs_reference is not None:
        print(f"vs whole-step-graph baseline: {result.gain_vs_reference:+.2%}")
    if prov.get("data_passes", 0) > 1:
        print(f"note: training read its batches {prov['data_passes']:.1f} times (raise the workload's train_batches "
              "for one pass; a second pass can over-fit and skew NE)")
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from erase_tune.bench import run_bench
    from erase_tune.workloads import get_workload

    workload = get_workload(ns.workload, _workload_args(ns.arg))
    cuts = [c for c in ns.cuts.split(",") if c] if ns.cuts else None
    only = [c.strip() for c in ns.only.split(",") if c.strip()] if ns.only else None
    result = run_bench(workload, budget=_budget(ns), device=ns.device, cuts=cuts, streams=ns.streams,
                       trace_dir=ns.trace, only=only)
    if ns.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    prov = result.provenance
    print(f"workload {result.workload} (batch {result.batch_size}) on {prov['device_name']}, "
          f"torch {prov['torch']}, cuda {prov['cuda']}; cuts {', '.join(prov['cuts'])}; {prov['streams']} streams")
    print(result.table())
    return 0


def cmd_start(ns: argparse.Namespace) -> int:
    from erase_tune.tune.driver import start_job

    live = sys.stdout.isatty()

    def show(p) -> None:
        best = (f"best within NE budget: {p.best.qps_gain:+.2%} at NE gap {p.best.ne_gap:+.2%} (trial {p.best.number})"
                if p.best else "no trial within the NE budget yet")
        status = f"[{p.done + p.failed}/{p.target}] done {p.done}, running {p.running}, failed {p.failed}; {best}"
        if live:
            print(f"\r\033[K{p.message}\n{status}", end="", flush=True)
        else:
            print(f"{p.message}\n  {status}", flush=True)

    summary = start_job(ns.space, study_name=ns.study, trials=ns.trials, storage=ns.storage,
                        ray_address=ns.ray_address, slots=ns.slots, on_progress=show)
    if live:
        print()
    o = summary.overhead
    print(f"study {summary.study_name}: {summary.complete} complete, {summary.failed} failed")
    if o["trials"]:
        print(f"scheduler overhead per trial: {o['driver_s']:.3f}s driver (ask/tell/db) + {o['dispatch_s']:.3f}s Ray "
              f"dispatch = {o['fraction']:.2%} of {o['trial_s']:.1f}s trial time; fresh worker start "
              f"{o['startup_s']:.2f}s more ({o['fraction_with_startup']:.1%} in all)")
    if summary.front:
        print("Pareto front within the NE budget (best first): "
              + ", ".join(f"trial {p.number} {p.qps_gain:+.2%}/{p.ne_gap:+.2%}" for p in summary.front))
    print(f"next: erase-tune status --study {summary.study_name}"
          + (f" --storage '{summary.storage}'" if ns.storage else "")
          + f"; erase-tune export --study {summary.study_name} -o best.yaml")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from erase_tune.tune.report import job_status

    status = job_status(ns.storage, ns.study)
    if ns.json:
        print(json.dumps(dataclasses.asdict(status), indent=2, default=str))
    else:
        print(status.table())
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from erase_tune.tune.report import export_plan

    plan, point = export_plan(ns.storage, ns.study, ns.output, max_ne_gap=ns.max_ne_gap, pick=ns.pick)
    print(f"wrote {ns.output}: trial {point.number}, QPS gain {point.qps_gain:+.2%}, NE gap {point.ne_gap:+.2%}")
    print(f"plan: {plan.describe()}")
    return 0


def cmd_dashboard(ns: argparse.Namespace) -> int:
    from erase_tune.tune.dashboard import serve

    serve(ns.storage, host=ns.host, port=ns.port)
    return 0


def cmd_db(ns: argparse.Namespace) -> int:
    from erase_tune.store import Store, default_storage_url

    store = Store(ns.storage or default_storage_url())
    try:
        if ns.action == "upgrade":
            store.upgrade()
        print(f"{store.url}: schema at revision {store.current_revision()}")
    finally:
        store.close()
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def _trial_args(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--plan", required=True, help="plan file (YAML)")
    _add_budget(p)


def _bench_args(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--cuts", help="comma-separated cut targets (default: the workload's candidates)")
    p.add_argument("--streams", type=int, default=4, help="side streams for the ERASE variants (default 4)")
    p.add_argument("--trace", metavar="DIR", help="also profile the ERASE variants and report stream overlap")
    p.add_argument("--only", help="comma-separated variant names to run (baselines always run)")
    _add_budget(p, quality=False)


def _storage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", help="SQLAlchemy URL (default sqlite:///erase-tune.db; postgresql+psycopg://... for "
                                     "several workers)")


def _start_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", required=True, help="search space file (search_spaces/*.yaml)")
    p.add_argument("--study", help="study name (default: the space file's name); an existing study is resumed")
    p.add_argument("--trials", type=int, help="trials the study should hold when done (default: the space's)")
    _storage(p)
    p.add_argument("--ray-address", help="join a Ray cluster (auto or host:port); default: start Ray locally")
    p.add_argument("--slots", type=int, help="trials in flight (default: one per GPU, else one per CPU)")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    _storage(p)
    p.add_argument("--json", action="store_true")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True)
    _storage(p)
    p.add_argument("--max-ne-gap", type=float, help="NE-gap budget (default: the job's)")
    p.add_argument("--pick", default="max-gain", choices=["max-gain", "knee"])
    p.add_argument("-o", "--output", required=True, help="plan file to write")


def _dashboard_args(p: argparse.ArgumentParser) -> None:
    _storage(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)


def _db_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["upgrade", "current"])
    _storage(p)


COMMANDS["trial"] = ("measure one plan against the baseline", _trial_args, cmd_trial)
COMMANDS["bench"] = ("time the runtime's variants side by side", _bench_args, cmd_bench)
COMMANDS["start"] = ("run (or resume) a tuning job", _start_args, cmd_start)
COMMANDS["status"] = ("a job and its Pareto front", _status_args, cmd_status)
COMMANDS["export"] = ("write the chosen plan file for production", _export_args, cmd_export)
COMMANDS["dashboard"] = ("serve optuna-dashboard on the job storage", _dashboard_args, cmd_dashboard)
COMMANDS["db"] = ("database schema: upgrade or show the current revision", _db_args, cmd_db)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="erase-tune", description="Autotune ERASE detachment placement.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, (help_text, add_args, func) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=func)
    return parser


def _quiet_libraries() -> None:
    """Optuna's per-trial INFO logs and experimental-API warnings would drown the progress display."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command in ("start", "status", "export", "dashboard"):
        _quiet_libraries()
    try:
        return ns.func(ns)
    except EraseTuneError as e:
        print(f"erase-tune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("erase-tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
