"""The benchmark runner: ``python -m erase_tune.benchmarks``.

    python -m erase_tune.benchmarks --list
    python -m erase_tune.benchmarks CASE [CASE...] --out DIR [--tag TAG] [case options]
    python -m erase_tune.benchmarks CASE --help
    python -m erase_tune.benchmarks --suite NAME --out DIR [--dry-run] [--var KEY=VALUE]

Each case's options come from its options dataclass; with several cases, each takes the options
it knows (an option no named case knows is an error). A case writes ``DIR/CASE[-TAG].json``
(``case``, ``options``, ``provenance``, ``complete``, ``result``) and ``DIR/CASE[-TAG].log`` (what it
printed), and prints its short table last. A case that needs CUDA, run where there is none, exits
2 with one line. Exit status: 0, 1 (a case failed), 2 (a usage error, or a case that cannot run here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Any

from erase_tune.benchmarks import load_cases
from erase_tune.benchmarks.case import Case, CaseError, Context, dump
from erase_tune.errors import EraseTuneError, one_line

PROG = "python -m erase_tune.benchmarks"


class _Tee:
    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _top_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, usage=f"{PROG} [--list] | CASE [CASE...] --out DIR [options] | "
                                              "--suite NAME --out DIR [--dry-run]",
                                 description="Run named benchmark cases or suites (docs/benchmarks.md).",
                                 add_help=False)
    ap.add_argument("--list", action="store_true", help="every case and suite, with the figures it regenerates")
    ap.add_argument("--out", type=Path, help="the output directory")
    ap.add_argument("--tag", default="", help="a suffix for the case's files (two runs of one case in one DIR)")
    ap.add_argument("--suite", help="run a suite of steps (a GPU campaign phase)")
    ap.add_argument("--dry-run", action="store_true", help="with --suite: print its steps and their limits")
    ap.add_argument("--var", action="append", default=[], metavar="KEY=VALUE", help="a suite variable")
    return ap


def listing() -> str:
    from erase_tune.benchmarks.suites import SUITES

    lines = ["cases (python -m erase_tune.benchmarks CASE --out DIR; CASE --help for its options):"]
    for c in load_cases().values():
        lines.append(f"  {c.name:<19} {c.description}")
        lines.append(f"  {'':<19} runs on: {c.needs()}"
                     + (f"; recorded with {c.recorded_with}, now this case" if c.recorded_with else ""))
        lines.extend(f"  {'':<19} figure: docs/benchmarks.md {f}" for f in c.figures)
    lines.append("suites (python -m erase_tune.benchmarks --suite NAME --out DIR [--dry-run]):")
    for s in SUITES.values():
        lines.append(f"  {s.name:<19} {s.description}")
        lines.append(f"  {'':<19} runs on: needs CUDA ({s.gpus} GPU{'s' if s.gpus > 1 else ''}); "
                     f"{len(s.steps())} steps: {', '.join(st.name for st in s.steps())}")
        lines.extend(f"  {'':<19} figure: docs/benchmarks.md {f}" for f in s.figures)
    return "\n".join(lines)


def _case_parser(case: Case) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"{PROG} {case.name}", description=case.description,
                                 epilog="Figures: " + "; ".join(case.figures))
    case.add_arguments(ap)
    return ap


def _needs_cuda(case: Case, options: Any) -> bool:
    if case.cuda == "required":
        return True
    return case.cuda == "optional" and str(getattr(options, "device", "")).startswith("cuda")


def _device(options: Any):
    import torch

    device = getattr(options, "device", None)
    if device in (None, "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def run_case(case: Case, options: Any, out: Path, *, tag: str = "", argv: list[str] | None = None) -> int:
    """Run one case into ``out``; its exit status."""
    import torch

    name = case.name + (f"-{tag}" if tag else "")
    if _needs_cuda(case, options) and not torch.cuda.is_available():
        hint = "; try --device cpu" if case.cuda == "optional" else ""
        print(f"{name}: needs CUDA, and there is no CUDA device here{hint}", file=sys.stderr)
        return 2
    from erase_tune.measure.provenance import provenance

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    opts = dataclasses.asdict(options)
    prov = provenance(_device(options), case=case.name, options=opts, command=[PROG, *(argv or [])])

    def save(result: dict[str, Any], complete: bool) -> None:
        dump(path, {"case": case.name, "tag": tag or None, "complete": complete, "options": opts,
                    "figures": list(case.figures), "provenance": prov, "result": result})

    ctx = Context(out=out, name=name, argv=[PROG, *(argv or [])], _save=save)
    with open(out / f"{name}.log", "w", encoding="utf-8") as log, \
            contextlib.redirect_stdout(_Tee(sys.stdout, log)), contextlib.redirect_stderr(_Tee(sys.stderr, log)):
        try:
            result = case.fn(options, ctx)
        except (CaseError, EraseTuneError) as e:  # a usage error (a missing file, a bad space): one line
            print(f"{name}: {one_line(str(e), 500)}", file=sys.stderr)
            return 2
        except Exception:  # noqa: BLE001 - the log keeps the traceback; the next case still runs
            traceback.print_exc()
            print(f"{name}: FAILED (traceback in {out / (name + '.log')})", file=sys.stderr)
            return 1
        table = result.get("table")
        save(result, True)
        print(f"{name}: wrote {path}")
        if table:
            print(table)
    return ctx.rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    top = _top_parser()
    if not names and any(a in ("-h", "--help") for a in argv):
        top.print_help()
        return 0
    ns, rest = top.parse_known_args(argv)
    if ns.list:
        print(listing())
        return 0
    if ns.suite:
        from erase_tune.benchmarks.suites import SUITES, run_suite

        if names or rest:
            top.error(f"--suite takes no cases or case options (got {' '.join(names + rest)})")
        if ns.suite not in SUITES:
            top.error(f"unknown suite {ns.suite!r} (known: {', '.join(SUITES)})")
        if ns.out is None and not ns.dry_run:
            top.error("--suite needs --out DIR")
        variables = {}
        for kv in ns.var:
            key, sep, value = kv.partition("=")
            if not sep:
                top.error(f"--var {kv!r} is not KEY=VALUE")
            variables[key] = value
        return run_suite(SUITES[ns.suite], ns.out or Path("OUT"), variables=variables, dry_run=ns.dry_run)
    if not names:
        top.error("name a case (--list shows them) or a --suite")
    cases = load_cases()
    unknown = [n for n in names if n not in cases]
    if unknown:
        top.error(f"unknown case {', '.join(unknown)} (known: {', '.join(cases)})")
    parsed = []
    leftovers = []
    for n in dict.fromkeys(names):
        parser = _case_parser(cases[n])
        if len(names) == 1:
            opts = parser.parse_args(rest)
            left: list[str] = []
        else:
            opts, left = parser.parse_known_args(rest)
        parsed.append((cases[n], cases[n].parse(vars(opts))))
        leftovers.append(set(left))
    stray = set.intersection(*leftovers) if leftovers else set()
    if stray:
        top.error(f"no named case knows {' '.join(a for a in rest if a in stray)}")
    if ns.out is None:
        top.error("--out DIR is required")
    rc = 0
    for case, opts in parsed:
        rc = max(rc, run_case(case, opts, ns.out, tag=ns.tag, argv=[*names, *argv]))
    return rc
