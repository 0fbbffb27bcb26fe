"""Issue 30's hostile campaign: its classes of input, generated rather than listed.

The project's rule for any input: a correct run, or ONE line naming the problem
(``erase-tune: error: ...``, exit 2; 1 when a job or export ran and got nothing, 3 when the
storage was lost), never a traceback; nothing already stored is lost or changed by a command
that only reads; every wait says within 2 s what it waits for and ends by its own timeout or
retry setting. Each area below generates its cases from products of command × argument
position × value family × storage kind (``itertools`` over fixed pools, a seeded
``random.Random`` where a product is too large), so CI runs the same cases every time:

- **outputs**: ``-o``/``--trace`` as existing files, new names, directories, missing parents,
  paths under a file and symlinks, each with a directory's spellings (``/``, ``/.``, ``//``,
  ``/..``) and written absolute, relative, ``./`` and through ``..``: export writes a plan only
  where a file is meant, and nothing else anywhere changes.
- **options**: every numeric option of trial, bench, start, export and status over values that
  must be refused (text, nan, inf, negatives, 400 digits, 10^12, the issue's ``--repeats 1``,
  ``--windows 1000000``) and values that may pass; a refusal names the option.
- **names**: module, candidate, workload, study and argument names with a trailing newline, a
  control or an invisible character at the start, middle or end.
- **factories**: ``--workload module:attr`` naming builtins, classes and functions that are no
  workload factory (``builtins:exit``, ``os:fork``, ``atexit:_run_exitfuncs``, ...).
- **urls**: storage URLs with white space, invisible or control characters around them, and
  SQLite's URI options (``?mode=ro``, ``?mode=rw``, ...), given as an option or ``$ERASE_TUNE_STORAGE``.
- **bombs**: YAML alias bombs (lists, mappings, merge keys, recursive aliases) in plan files,
  in space files and in ``--arg`` values: refused within a second in one line, output small.
- **criteo**: Criteo files with a poisoned field (400-digit and 4400-digit counts, nan, NUL,
  invisible characters, ...) or a broken shape.
- **storage**: a finished job's storage broken in one of many ways (two rows or an unknown
  revision in a version table, a dropped table, attributes that are not JSON or of the wrong
  kind, a damaged job row, another application's database, a plain Optuna study) under each
  reader and writer, ``start`` included (its Ray executor and trial loop stubbed out: the
  storage is opened after Ray starts); a reader leaves the file byte for byte.
- **resume**: a study tuned over one space's modes, resumed with another's (the trial loop's
  proposal step, in-process, with no Ray).
- **environment**: standard output on /dev/full, into a closed pipe and onto a full (tiny tmpfs,
  where it can be mounted) disk, with export's plan, report's figures and bench's trace there
  too; a terminal that takes only ASCII, with non-ASCII study names and paths; a journal
  directory nothing can be written in.
- **waits** (few, slow): a SQLite storage locked by another process (an exclusive transaction,
  its schema lock), PostgreSQL URLs and Ray addresses where another service listens.

Every area asserts a floor on its case count (:meth:`Bounds.report`); together at least 1,500.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hostile_world_30 import TINY_SPACE, World, checkpoint, digest, run, tree
from tests.test_hostile import _say, one_line
from tests.test_hostile_ops import Cases

STUDY = "finished"
TINY_ARGS = {"batch": 16, "rows": 10, "num_tables": 2, "train_batches": 4, "eval_batches": 1, "width": 8, "depth": 1,
             "emb_dim": 4, "sub_out": 4}
TINY = [a for k, v in TINY_ARGS.items() for a in ("--arg", f"{k}={v}")]
BUDGET = ["--warmup", "5", "--windows", "1", "--window-steps", "1"]
MISFIT = "cuts: [nosuch.0]\n"
"""A plan the tiny CTR model refuses once it is built: a trial whose other input passed ends
there in one line, without training."""
EXIT_CODES = frozenset({0, 1, 2, 3})
MAX_OUTPUT = 64 * 1024
"""Most a refused or bounded command may print on stdout (a bomb must not become megabytes of JSON)."""


class Campaign(Cases):
    """Bounds per area: most cases are one in-process command on a copied SQLite file (the
    environment's include a report's figures and a bench on a full disk: seconds on two busy cores)."""

    LIMITS = {"outputs": 5.0, "options": 5.0, "names": 5.0, "factories": 5.0, "urls": 5.0, "bombs": 2.0,
              "criteo": 5.0, "storage": 8.0, "resume": 3.0, "environment": 30.0, "waits": 12.0}


@pytest.fixture(scope="module")
def campaign(pytestconfig: pytest.Config) -> Iterator[Campaign]:
    # What the cases import, imported first: the first case of an area is timed for itself.
    import erase_tune.measure.bench
    import erase_tune.tune.run.check
    import erase_tune.tune.run.job
    import erase_tune.tune.views.export
    import erase_tune.tune.views.html_report
    import erase_tune.tune.views.status
    import erase_tune.workloads.ctr  # noqa: F401

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: intra-op threads only contend
    try:
        yield Campaign(lambda line: _say(pytestconfig, line))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("world30"))
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(autouse=True)
def _process_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No storage, Ray address or journal of the developer's; storage waits short (SQLite's busy
    timeout 0.2 s, the retry window 0.5 s: a wait is still said, and still ends by the setting);
    cwd a scratch directory; the logger, Optuna's verbosity, warnings filters and sys.path put back."""
    import logging
    import warnings

    import optuna

    import erase_tune.store.engine

    for name in ("ERASE_TUNE_STORAGE", "RAY_ADDRESS", "ERASE_TUNE_MAX_UPLOAD_MB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ERASE_TUNE_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.setenv("ERASE_TUNE_STORAGE_RETRY_S", "0.5")
    monkeypatch.setattr(erase_tune.store.engine, "SQLITE_BUSY_TIMEOUT_MS", 200)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    logger = logging.getLogger("erase_tune")
    saved = (list(logger.handlers), logger.level, logger.propagate, optuna.logging.get_verbosity(), list(sys.path))
    try:
        with warnings.catch_warnings():
            yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
        optuna.logging.set_verbosity(saved[3])
        sys.path[:] = saved[4]


@dataclasses.dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str
    line: str
    """The one error line ("" on success)."""
    stamps: list[tuple[float, str]]
    took: float


def label_of(argv: list[Any]) -> str:
    return " ".join(repr(str(a)[:50]) + ("…" if len(str(a)) > 50 else "") for a in argv)


def ran(c: Campaign, area: str, argv: list[Any], *, env: dict[str, str | None] | None = None, stdout: Any = None,
        stderr: Any = None, cwd: Path | None = None, codes: frozenset[int] = EXIT_CODES, note: str = "") -> Ran:
    """Run one case and check the CLI's contract: an exit code it documents, no traceback, and
    for a failure exactly one error line, the last, printable and bounded."""
    where = f"{area}: erase-tune {label_of(argv)}{note}"
    t0 = time.monotonic()
    with c.case(area, where[:200]):
        try:
            code, out, err, stamps = run(argv, env=env, stdout=stdout, stderr=stderr, cwd=cwd)
        except Exception as e:  # the watchdog's _Hung is a BaseException: it goes through
            raise AssertionError(f"{where}: raised {type(e).__name__}: {str(e)[:800]}") from e
    took = time.monotonic() - t0
    assert "Traceback" not in err, f"{where}: a traceback on stderr:\n{err[-3000:]}"
    assert code in codes, f"{where}: exit {code}: {err[-1500:]!r}"
    errors = [line for line in err.splitlines() if "error:" in line]
    if code == 0:
        assert not errors, f"{where}: exit 0 with an error line: {errors[:3]}"
        line = ""
    elif code in (1, 2, 3):
        assert len(errors) == 1, f"{where}: exit {code} with {len(errors)} error lines: {err[-2000:]!r}"
        line = errors[0]
        assert line.startswith("erase-tune: error: "), f"{where}: {line[:300]!r}"
        assert err.rstrip("\n").splitlines()[-1] == line, f"{where}: the error is not the last line: {err[-1500:]!r}"
        one_line(line, where)
    else:
        line = ""
    c.outcomes[f"{area}:exit {code}"] += 1
    return Ran(code, out, err, line, stamps, took)


# -- outputs -------------------------------------------------------------------------------------------

OUTPUT_KINDS = {"existing-file": "existing.yaml", "fresh": "new.yaml", "existing-dir": "adir",
                "missing-parent": "missing/new.yaml", "under-a-file": "afile/new.yaml", "symlink-to-dir": "linkdir",
                "dangling-symlink": "dangling"}
SUFFIXES = ("", "/", "/.", "//", "/..")
SPELLINGS = ("absolute", "relative", "through-dotdot")
WRITABLE = ("existing-file", "fresh", "dangling-symlink")
"""Where export may write its plan (a dangling symlink is replaced, never written through)."""


def _output_dir(world: World) -> Path:
    d = world.fresh_dir("out")
    (d / "existing.yaml").write_text("# my earlier plan\n")
    (d / "adir").mkdir()
    (d / "afile").write_text("a file\n")
    (d / "linkdir").symlink_to(d / "adir", target_is_directory=True)
    (d / "dangling").symlink_to(d / "nowhere.yaml")
    return d


def test_output_paths(campaign: Campaign, world: World) -> None:
    db = world.copy(world.fresh_dir("outputs-db"))
    url = f"sqlite:///{db}"
    closed = f"127.0.0.1:{world.closed_port}"
    for kind, suffix, spelling, command in itertools.product(OUTPUT_KINDS, SUFFIXES, SPELLINGS,
                                                             ("export", "report", "bench")):
        d = _output_dir(world)
        rel = OUTPUT_KINDS[kind] + suffix
        path = {"absolute": str(d / OUTPUT_KINDS[kind]) + suffix, "relative": "./" + rel if kind == "fresh" else rel,
                "through-dotdot": "adir/../" + rel}[spelling]
        argv = {"export": ["export", "--study", STUDY, "--storage", url, "--ray-address", closed, "-o", path],
                "report": ["report", "--study", STUDY, "--storage", f"sqlite:///{d}/missing.db", "-o", path],
                "bench": ["bench", "--workload", "nosuch", "--device", "cpu", "--trace", path]}[command]
        before = tree(d)
        r = ran(campaign, "outputs", argv, cwd=d, note=f" ({kind}{suffix!r}, {spelling})")
        after = tree(d)
        where = f"{command} -o {path!r} ({kind}, suffix {suffix!r}, {spelling})"
        flag = "--trace: " if command == "bench" else "-o: "
        if command == "export" and kind in WRITABLE and not suffix:
            assert r.code == 0, f"{where}: exit {r.code}: {r.line}"
            target = os.path.normpath(os.path.relpath(d / path if not os.path.isabs(path) else path, d))
            from erase_tune.runtime import ErasePlan

            assert ErasePlan.load(d / target).provenance["study"] == STUDY
            changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
            assert changed <= {target}, f"{where}: it changed {sorted(changed)}"
            campaign.outcomes["outputs:wrote the plan"] += 1
            continue
        assert r.code == 2, f"{where}: exit {r.code}"
        assert after == before, f"{where}: refused, yet it changed {sorted(set(after) ^ set(before))}"
        if command == "export" or kind in ("existing-file", "under-a-file"):
            assert flag in r.line, f"{where}: not refused as an output path: {r.line}"
        elif flag not in r.line:  # a directory's place passed: the command stopped at what came next
            assert "no database file" in r.line or "unknown workload" in r.line, f"{where}: {r.line}"
    campaign.report("outputs", 315)


# -- numeric options -------------------------------------------------------------------------------

NEVER = ["x", "", "nan", "inf", "-inf", "-1", "1e999", "1e308", "9" * 400, "1000000000000"]
"""Values no numeric option takes: each must be refused, naming the option."""
MAYBE = ["0", "5", "1e3", "1_0", "1", "60", " 5", "\u0663", "2", "100", "1000", "1.5", "-0", "5 ", "+3", "0x10"]
"""Values an option may take or refuse (in one line naming it)."""
OPTIONS: dict[str, list[tuple[str, list[str]]]] = {
    # command: [(option, values it must refuse besides NEVER)]
    "start": [("--trials", ["0"]), ("--slots", ["0", "100000"]), ("--gpu-wait", ["604801"]),
              ("--grace-period", ["0", "9"]), ("--repeats", ["0", "1", "1001", "-3", "1000000000"]),
              ("--quality-scale", ["1000000"]), ("--quality-seeds", ["0"]), ("--time-budget", ["0", "8d", "0.5s"])],
    "export": [("--repeats", ["0", "1", "-3", "1001", "1000000000"]),
               ("--max-ne-gap", ["-0.1", "100.5", "1e9"]), ("--quality-scale", ["1000000"]),
               ("--quality-seeds", ["1000000"])],
    "trial": [("--warmup", ["0", "4"]), ("--windows", ["0", "21", "1000000"]), ("--window-steps", ["0"]),
              ("--quality-steps", ["1000001"]), ("--seed", ["4294967296"]), ("--noise-floor", ["101"])],
    "bench": [("--streams", ["0", "65"]), ("--warmup", ["0"]), ("--windows", ["0", "1000000"]),
              ("--window-steps", ["0"]), ("--seed", ["4294967296"]), ("--noise-floor", ["101"])],
    "status": [("--trial", ["18", "99"])],
}
SLOW_COMMANDS = {"start": 4, "export": 2, "bench": 4, "status": 4, "trial": 8}
"""Commands whose accepted cases cost a storage read or a model: they get that many MAYBE values."""


def _needles(option: str) -> tuple[str, ...]:
    bare = option.lstrip("-").replace("-", "_")
    return (option, bare, bare.split("_")[0] + "_steps" if option == "--warmup" else bare)


def test_option_values(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("options")
    misfit = d / "misfit.yaml"
    misfit.write_text(MISFIT)
    db = world.copy(d)
    closed = f"127.0.0.1:{world.closed_port}"
    base = {
        "start": lambda: ["start", "--space", world.space, "--storage", f"sqlite:///{d}/new.db",
                          "--ray-address", closed],
        "export": lambda: ["export", "--study", STUDY, "--storage", f"sqlite:///{db}", "-o", d / "best.yaml",
                           "--ray-address", closed],
        "trial": lambda: ["trial", "--workload", "ctr", *TINY, "--plan", misfit, "--device", "cpu", *BUDGET],
        "bench": lambda: ["bench", "--workload", "ctr", *TINY, "--device", "cpu", "--cuts", "nosuch.0", *BUDGET],
        "status": lambda: ["status", "--study", STUDY, "--storage", f"sqlite:///{db}", "--json"],
    }
    # What a command whose option passed stops at: Ray (nothing listens), the misfit plan, the cut.
    passed = {"start": "nothing answers", "export": "nothing answers", "trial": "nosuch.0", "bench": "nosuch.0",
              "status": ""}
    for command, options in OPTIONS.items():
        maybe = MAYBE[: SLOW_COMMANDS.get(command, len(MAYBE))]
        for option, refused in options:
            for value in NEVER + refused + maybe:
                _option_case(campaign, command, option, value, value in NEVER or value in refused,
                             base[command](), passed[command])
    assert not (d / "new.db").exists(), "a refused start created its storage"
    campaign.report("options", 400)


def _option_case(campaign: Campaign, command: str, option: str, value: str, must: bool, argv: list[Any],
                 passed: str) -> None:
    r = ran(campaign, "options", [*argv, option, value])
    where = f"{command} {option} {value!r}"
    named = any(n in r.line for n in _needles(option))
    if must:
        assert r.code == 2 and named, f"{where} must be refused naming {option}: exit {r.code}: {r.line}"
        campaign.outcomes["options:refused, naming the option"] += 1
    elif r.code != 0 and not named:
        assert passed and passed in r.line, f"{where}: exit {r.code}: {r.line}"


# -- names with a control or invisible character ----------------------------------------------------------

ODD_CHARS = ["\n", "\r", "\t", "\x1b", "\x00", "\x7f", "\x85", "\u200b", "\u202e", "\u2028", "\ufeff", " "]
POSITIONS = ("end", "start", "middle")


def _spoil(name: str, char: str, where: str) -> str:
    at = {"end": len(name), "start": 0, "middle": len(name) // 2}[where]
    return name[:at] + char + name[at:]


def test_names(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("names")
    db = world.copy(d)
    url = f"sqlite:///{db}"
    before = digest(db)
    closed = f"127.0.0.1:{world.closed_port}"
    counter = itertools.count()

    def written(text: str) -> Path:
        p = d / f"doc-{next(counter)}.yaml"
        p.write_text(text)
        return p

    for char, position in itertools.product(ODD_CHARS, POSITIONS):
        q = lambda s: json.dumps(s)  # noqa: E731 - a YAML double-quoted scalar, escapes and all
        module = _spoil("subarchs.0", char, position)
        for base in ("ctr", "tests.tune.faulty:workload"):
            r = ran(campaign, "names", ["trial", "--workload", _spoil(base, char, position), *TINY, "--plan",
                                        world.plan, "--device", "cpu", *BUDGET])
            assert r.code == 2 and "workload" in r.line, r.line
        for text in (f"cuts: [{q(module)}]\n", f"num_streams: 1\nplacements: [{{module: {q(module)}, stream: 1}}]\n"):
            plan = written(text)
            r = ran(campaign, "names", ["trial", "--workload", "ctr", *TINY, "--plan", plan, "--device", "cpu",
                                        *BUDGET])
            assert r.code == 2 and str(plan) in r.line, r.line
        space = written(TINY_SPACE.replace("candidates: [subarchs.0, subarchs.1]",
                                           f"candidates: [{q(module)}, subarchs.1]"))
        for argv in (["check", "--space", space], ["start", "--space", space, "--storage", f"sqlite:///{d}/new.db",
                                                   "--ray-address", closed]):
            r = ran(campaign, "names", argv)
            assert r.code == 2 and str(space) in r.line, r.line
        r = ran(campaign, "names", ["start", "--space", world.space, "--study", _spoil("my-study", char, position),
                                    "--storage", f"sqlite:///{d}/new.db", "--ray-address", closed])
        inside = char == " " and position == "middle"  # "my- study": a visible name status can be given back
        assert r.code == 2 and ("--study" in r.line or inside and "nothing answers" in r.line), r.line
        r = ran(campaign, "names", ["trial", "--workload", "ctr", *TINY, "--arg", _spoil("rows", char, position) + "=5",
                                    "--plan", world.plan, "--device", "cpu", *BUDGET])
        assert r.code == 2 and "argument" in r.line, r.line
        if position == "end":  # the costlier ones (a storage read, a model built): once per character
            for argv in (["status", "--study", _spoil(STUDY, char, position), "--storage", url],
                         ["export", "--study", _spoil(STUDY, char, position), "--storage", url, "-o", d / "b.yaml"],
                         ["bench", "--workload", "ctr", *TINY, "--device", "cpu", "--cuts", module, *BUDGET]):
                r = ran(campaign, "names", argv)
                assert r.code == 2, r.line
    assert digest(db) == before and not (d / "new.db").exists() and not (d / "b.yaml").exists()
    campaign.report("names", 300)


# -- workload factories that are not ------------------------------------------------------------------

NOT_FACTORIES = [
    "builtins:exit", "builtins:quit", "builtins:print", "builtins:dict", "builtins:input", "builtins:breakpoint",
    "builtins:help", "builtins:open", "builtins:eval", "builtins:__import__", "sys:exit", "sys:modules", "os:abort",
    "os:_exit", "os:fork", "os:getpid", "os:system", "os:kill", "os:path.join", "time:sleep", "signal:pause",
    "signal:raise_signal", "faulthandler:_sigsegv", "threading:Event", "threading:main_thread", "gc:collect",
    "atexit:_run_exitfuncs", "_thread:interrupt_main", "collections:OrderedDict", "json:dumps", "shutil:rmtree",
    "os.path:join", "functools:partial", "subprocess:Popen", "operator:itemgetter", "math:pi", "string:ascii_letters",
    "erase_tune.workloads:BUILTINS", "erase_tune.workloads:get_workload", "platform:system", "random:random",
    "socket:socket", "tempfile:gettempdir", "importlib:import_module", "tests.tune.faulty:nope",
    "nosuch_module_30:f", "os:", ":f", "a..b:c", "os:path..join", "erase_tune.workloads.ctr:workload.__doc__",
]
"""Builtins that would end or fork the process, classes, functions of other signatures, values:
none is a workload factory. (Python functions that take no argument and wait for a terminal,
``pdb:set_trace``, are not run here: a factory is trusted like a script.)"""


def test_factories(campaign: Campaign, world: World) -> None:
    pid = os.getpid()
    for name, command, extra in itertools.product(NOT_FACTORIES, ("trial", "bench"), ([], ["--arg", "x=1"])):
        argv = [command, "--workload", name, *extra, "--device", "cpu", *BUDGET]
        if command == "trial":
            argv += ["--plan", world.plan]
        r = ran(campaign, "factories", argv)
        assert r.code == 2 and "workload" in r.line, f"--workload {name!r}: exit {r.code}: {r.line}"
        assert os.getpid() == pid
    campaign.report("factories", 200)


# -- storage URLs ---------------------------------------------------------------------------------------

PADS = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\u00a0", "\u2003", "\u3000", "\u200b", "\ufeff", "\x1b"]
QUERIES = ["?mode=ro", "?mode=rw", "?mode=rwc", "?mode=memory", "?uri=true", "?mode=ro&uri=true", "?immutable=1",
           "?nolock=1", "?cache=shared", "?timeout=0", "?check_same_thread=false", "?vfs=unix-none"]


def test_storage_urls(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("urls")
    db = world.copy(d)
    url = f"sqlite:///{db}"
    closed = f"127.0.0.1:{world.closed_port}"
    before = tree(d)
    commands = {"status": ["status"], "db current": ["db", "current"], "db upgrade": ["db", "upgrade"],
                "report": ["report", "--study", STUDY, "-o", d / "rep"],
                "export": ["export", "--study", STUDY, "-o", d / "b.yaml", "--ray-address", closed],
                "start": ["start", "--space", world.space, "--ray-address", closed], "environment": ["status"]}
    spelled = [(pad + url if side == "before" else url + pad if side == "after" else pad + url + pad, repr(pad))
               for pad, side in itertools.product(PADS, ("before", "after", "both"))]
    spelled += [(url + query, query) for query in QUERIES]
    for (given, how), (name, argv) in itertools.product(spelled, commands.items()):
        if name == "environment":
            r = ran(campaign, "urls", argv, env={"ERASE_TUNE_STORAGE": given}, note=f" ($ERASE_TUNE_STORAGE {how})")
            needle = "$ERASE_TUNE_STORAGE" if given != given.strip() or not given.isprintable() else "SQLite options"
        else:
            r = ran(campaign, "urls", [*argv, "--storage", given], note=f" ({how})")
            needle = ("white space" if given != given.strip() else "invisible or control" if not given.isprintable()
                      else "SQLite options")
        assert r.code == 2 and needle in r.line, f"{name} with the storage URL {how}: exit {r.code}: {r.line}"
        assert tree(d) == before, f"{name} with the storage URL {how}: it changed what was stored or made a file"
    campaign.report("urls", 300)


# -- alias bombs -----------------------------------------------------------------------------------------


def bomb(depth: int, width: int, style: str) -> str:
    """``width ** depth`` values through ``depth`` anchors, in flow style: lists, mappings, or
    mappings merged into each other (``<<``); ``recursive``: an alias inside its own anchor."""
    if style == "recursive":
        return "&r [x, *r]" if width % 2 else "&r {x: *r}"
    if style == "list":
        levels = [f"&l0 [{', '.join(['x'] * width)}]"] + [
            f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
        return "[" + ", ".join(levels) + "]"
    if style == "mapping":
        levels = ["&l0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}"] + [
            f"&l{i} {{" + ", ".join(f"k{j}: *l{i - 1}" for j in range(width)) + "}" for i in range(1, depth)]
        return "[" + ", ".join(levels) + "]"
    levels = ["&l0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}"] + [
        f"&l{i} {{<<: *l{i - 1}, " + ", ".join(f"n{i}_{j}: *l{i - 1}" for j in range(width)) + "}"
        for i in range(1, depth)]
    return "[" + ", ".join(levels) + "]"


BOMB_PLACES = {
    "plan provenance": ("plan", lambda b: f"{MISFIT}provenance: {{x: {b}}}\n"),
    "plan cuts": ("plan", lambda b: f"cuts: {b}\n"),
    "plan document": ("plan", lambda b: f"{b}\n"),
    "plan placements": ("plan", lambda b: f"num_streams: 1\nplacements: {b}\n"),
    "space workload args": ("space", lambda b: TINY_SPACE.replace("rows: 10", f"rows: {b}")),
    "space seed": ("space", lambda b: TINY_SPACE + f"seeds: [{{name: s, plan: {{provenance: {{x: {b}}}}}}}]\n"),
    "space candidates": ("space", lambda b: TINY_SPACE.replace("[subarchs.0, subarchs.1]", b)),
    "arg rows": ("arg", lambda b: f"rows={b}"),
    "arg data": ("arg", lambda b: f"data={b}"),
    "arg unknown": ("arg", lambda b: f"nokey={b}"),
}


def test_alias_bombs(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("bombs")
    misfit = d / "misfit.yaml"
    misfit.write_text(MISFIT)
    closed = f"127.0.0.1:{world.closed_port}"
    bombs = [(depth, width, style) for depth, width, style in
             itertools.product(range(2, 9), (2, 5, 10), ("list", "mapping", "merge"))]
    bombs += [(1, 1, "recursive"), (1, 2, "recursive")]
    places = list(BOMB_PLACES)
    for i, (depth, width, style) in enumerate(bombs):
        text = bomb(depth, width, style)
        for place in (places[(i + k) % len(places)] for k in range(0, len(places) - 1, 3)):
            kind, make = BOMB_PLACES[place]
            doc = make(text)
            path = d / f"bomb-{i}-{place.replace(' ', '-')}.yaml"
            path.write_text(doc)
            argv = {"plan": ["trial", "--workload", "ctr", *TINY, "--plan", path, "--device", "cpu", *BUDGET, "--json"],
                    "space": ["start", "--space", path, "--storage", f"sqlite:///{d}/new.db", "--ray-address", closed,
                              "--json"],
                    "arg": ["trial", "--workload", "ctr", *TINY, "--arg", doc, "--plan", misfit, "--device", "cpu",
                            *BUDGET, "--json"]}[kind]
            r = ran(campaign, "bombs", argv, note=f" ({style} bomb of {width}^{depth} in the {place})")
            where = f"a {style} bomb of {width}^{depth} values in the {place}"
            assert r.code == 2, f"{where}: exit {r.code}"  # a small one passes the loader: the misfit plan stops it
            assert len(r.out) <= MAX_OUTPUT, f"{where}: {len(r.out)} bytes on stdout"
            if style == "recursive" or width ** depth > 100_000:
                assert "100000 values" in r.line or "nested" in r.line, f"{where}: {r.line}"
                campaign.outcomes["bombs:refused as a bomb"] += 1
    assert not (d / "new.db").exists()
    campaign.report("bombs", 190)


# -- Criteo files ----------------------------------------------------------------------------------------

INT_POISON = ["9" * 400, "-" + "9" * 400, "9" * 4400, "1e400", "nan", "inf", "0x10", " 5", "\u0663", "1_000", "+3",
              "9" * 20, "\x00", "\u00e9", "\u200b", "", "1.5", "--5"]
REFUSED_COUNTS = {"9" * 400, "9" * 4400, "1e400", "nan", "inf", "0x10", "\x00", "\u00e9", "\u200b", "1.5", "--5"}
"""Values no count may take (the others Python's int() reads: padded, signed, other digits)."""
CAT_POISON = ["f" * 400, "\x00", "\u00e9" * 10, "", " ", "\u202e", "a" * 10_000, "\t"]
LABEL_POISON = ["2", "-1", "1.0", "", "9" * 400, "nan", " 1", "1\u200b", "\x00"]
SHAPES = ["too few fields", "too many fields", "crlf", "blank lines only", "bom", "not utf-8", "nul line", "one line",
          "empty"]


def _criteo(poison: tuple[str, int, str] | None = None, shape: str | None = None, lines: int = 24) -> bytes:
    rows = []
    for n in range(lines):
        fields = [str(n % 2)] + [str(n + i) for i in range(13)] + [f"{n * 31 + i:08x}" for i in range(26)]
        if poison is not None and n == 1:  # read: a trial reads only the lines its batches need
            _, column, value = poison
            fields[column] = value
        rows.append("\t".join(fields))
    text = "\n".join(rows) + "\n"
    if shape == "too few fields":
        text = text.replace("\t", "", 3)
    elif shape == "too many fields":
        text += "\t".join(["1"] * 41) + "\n"
    elif shape == "crlf":
        text = text.replace("\n", "\r\n")
    elif shape == "blank lines only":
        text = "\n\n   \n\t\n"
    elif shape == "bom":
        text = "\ufeff" + text
    elif shape == "nul line":
        text += "\x00" * 40 + "\n"
    elif shape == "one line":
        text = rows[0] + "\n"
    elif shape == "empty":
        text = ""
    data = text.encode("utf-8")
    return data + b"\xff\xfe\n" if shape == "not utf-8" else data


def test_criteo_files(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("criteo")
    misfit = d / "misfit.yaml"
    misfit.write_text(MISFIT)
    cases: list[tuple[str, bytes, bool]] = []  # (what, the file, whether it must be refused)
    for value, column in itertools.product(INT_POISON, (1, 5, 9, 13)):
        cases.append((f"I{column} = {value[:12]!r}", _criteo(("int", column, value)), value in REFUSED_COUNTS))
    for value, column in itertools.product(CAT_POISON, (14, 39)):
        cases.append((f"C{column - 13} = {value[:12]!r}", _criteo(("cat", column, value)), value == "\t"))
    cases += [(f"label {value[:12]!r}", _criteo(("label", 0, value)), True) for value in LABEL_POISON]
    cases += [(shape, _criteo(shape=shape), shape not in ("crlf", "too many fields", "nul line"))
              for shape in SHAPES]
    args = {**TINY_ARGS, "num_tables": 26, "batch": 4, "train_batches": 2, "eval_batches": 1}
    flags = [a for k, v in args.items() for a in ("--arg", f"{k}={v}")]
    for i, (what, data, refused) in enumerate(cases):
        path = d / f"day-{i}.tsv"  # its own name: a trial reuses the data it prepared for the same arguments
        path.write_bytes(data)
        r = ran(campaign, "criteo", ["trial", "--workload", "ctr", *flags, "--arg", f"data={path}", "--plan", misfit,
                                     "--device", "cpu", *BUDGET], note=f" ({what})")
        assert r.code == 2, f"criteo {what}: exit {r.code}"
        if refused:  # the file is refused, naming it (the 400-digit count was an OverflowError traceback)
            assert str(path) in r.line and "nosuch.0" not in r.line, f"criteo {what}: {r.line}"
            campaign.outcomes["criteo:file refused"] += 1
        else:
            assert "nosuch.0" in r.line, f"criteo {what}: {r.line}"
    campaign.report("criteo", 100)


# -- storage that is not what it seems ----------------------------------------------------------------------


def _sql(*statements: str) -> Any:
    def apply(path: Path) -> None:
        con = sqlite3.connect(path)
        try:
            con.execute("PRAGMA foreign_keys=OFF")
            for s in statements:
                con.execute(s)
            con.commit()
        finally:
            con.close()

    return apply


def _attr(table: str, owner: str, key: str, value: str) -> Any:
    """Set ``key`` to the raw JSON text ``value``: of trial 12 (on the front) or of the study."""
    owner_sql = "1" if table.startswith("study") else "(SELECT trial_id FROM trials WHERE number = 12)"
    return _sql(f"DELETE FROM {table} WHERE key = '{key}' AND {owner} = {owner_sql}",
                f"INSERT INTO {table} ({owner}, key, value_json) VALUES ({owner_sql}, '{key}', "
                f"'{value.replace(chr(39), chr(39) * 2)}')")


def _whole_file(how: str) -> Any:
    def apply(path: Path) -> None:
        data = path.read_bytes()
        if how == "truncated":
            path.write_bytes(data[: len(data) // 2])
        elif how == "zeroed page":
            path.write_bytes(data[:4096] + b"\0" * 4096 + data[8192:])
        elif how == "garbage after":
            path.write_bytes(data + os.urandom(3000))
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "text":
            path.write_text("not a database at all\n" * 100)
        elif how == "other application":
            path.unlink()
            _sql("CREATE TABLE notes (body TEXT)", "INSERT INTO notes VALUES ('my notes')")(path)
        elif how == "plain optuna study":
            path.unlink()
            import optuna

            storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
            plain = optuna.create_study(storage=storage, study_name=STUDY, direction="minimize")
            plain.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
            storage.engine.dispose()
        elif how == "plain study beside ours":
            import optuna

            storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
            plain = optuna.create_study(storage=storage, study_name="plain", direction="minimize")
            plain.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
            storage.engine.dispose()

    return apply


BAD_JSON = ["not json", "{", "", "[1,", "[" * 3000 + "]" * 3000]
WRONG_KINDS = ['"x"', "5", "true", "null", "[]", "[1, 2]", "{}", '{"a": 1}', "NaN", "1e999", '"' + "x" * 20_000 + '"']
STUDY_KEYS = ["workload", "max_ne_gap", "gain_over", "noise_floor", "ne_noise_band", "step_cost", "reference_error",
              "drivers_started"]
TRIAL_KEYS = ["plan", "plan_summary", "seed_name", "gain_vs_eager", "gain_vs_graph", "gain_lo", "gain_hi",
              "ne_gap", "feasible", "exact", "duplicate_of", "attempts", "failure_reason", "phase", "windows",
              "candidate_p90_qps"]
OUR_TABLES = ["et_jobs", "et_confirmations", "et_quality_confirmations", "et_trial_outcomes", "et_exports",
              "et_noise_floors", "et_baseline_cache"]
OPTUNA_TABLES = ["studies", "study_directions", "study_user_attributes", "study_system_attributes", "trials",
                 "trial_user_attributes", "trial_system_attributes", "trial_params", "trial_values",
                 "trial_intermediate_values", "trial_heartbeats", "version_info", "alembic_version"]


def storage_mutations() -> dict[str, Any]:
    m: dict[str, Any] = {"as stored": _sql()}
    for rev in ("0001", "0002", "9999_future"):
        m[f"two version rows ({rev})"] = _sql(f"INSERT INTO erase_tune_alembic_version VALUES ('{rev}')")
    for rev in ("9999_future", "zz", "0001", "0002", ""):
        m[f"revision {rev!r}"] = _sql(f"UPDATE erase_tune_alembic_version SET version_num = '{rev}'")
    m["no revision row"] = _sql("DELETE FROM erase_tune_alembic_version")
    m["Optuna: two version rows"] = _sql("INSERT INTO alembic_version VALUES ('v1.0.0')")
    m["Optuna: newer schema"] = _sql("UPDATE alembic_version SET version_num = 'v99.0.0'")
    m["Optuna: version_info"] = _sql("UPDATE version_info SET schema_version = 99")
    for table in OUR_TABLES + ["erase_tune_alembic_version"] + OPTUNA_TABLES:
        m[f"dropped {table}"] = _sql(f"DROP TABLE {table}")
    for key, value in itertools.product(STUDY_KEYS, BAD_JSON + WRONG_KINDS):
        m[f"study {key} = {value[:10]!r}"] = _attr("study_user_attributes", "study_id", key, value)
    for key, value in itertools.product(TRIAL_KEYS, BAD_JSON + WRONG_KINDS):
        m[f"trial 12 {key} = {value[:10]!r}"] = _attr("trial_user_attributes", "trial_id", key, value)
    for value in BAD_JSON + ['"x"', "[]"]:
        m[f"constraints = {value[:10]!r}"] = _attr("trial_system_attributes", "trial_id", "constraints", value)
    for column, value in itertools.product(("settings", "space_yaml", "workload"), BAD_JSON + ["[]", "5"]):
        m[f"job {column} = {value[:10]!r}"] = _sql(f"UPDATE et_jobs SET {column} = '{value}'")
    m["job space is a bomb"] = _sql(f"UPDATE et_jobs SET space_yaml = 'workload: {bomb(9, 10, 'list')}'")
    for column in ("samples", "provenance"):
        for value in BAD_JSON[:2] + ["[]"]:
            m[f"confirmation {column} = {value!r}"] = _sql(f"UPDATE et_confirmations SET {column} = '{value}'")
    m["quality per_seed = 'x'"] = _sql("UPDATE et_quality_confirmations SET per_seed = '\"x\"'")
    for how in ("truncated", "zeroed page", "garbage after", "empty", "text", "other application",
                "plain optuna study", "plain study beside ours"):
        m[f"file: {how}"] = _whole_file(how)
    return m


def stored_rows(path: Path) -> dict[str, str] | str | None:
    """What each table of a SQLite file holds, row by row (a writer that refuses may have set its
    own tables up beside them, which loses nothing); the bytes of a file that is no database."""
    if not path.exists():
        return None
    try:
        con = sqlite3.connect(path)  # not mode=ro: a read-only connection leaves a WAL file's -wal and -shm behind
        try:
            tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
            return {t: hashlib.sha256(repr(con.execute(f'SELECT * FROM "{t}" ORDER BY rowid').fetchall()).encode())
                    .hexdigest() for t in tables}
        finally:
            con.close()
    except sqlite3.DatabaseError:
        return digest(path)


def _kept(before: dict[str, str] | str | None, after: dict[str, str] | str | None) -> bool:
    if isinstance(before, dict) and isinstance(after, dict):
        return all(after.get(t) == h for t, h in before.items())
    return before == after


class _NoRay:
    """``start``'s executor, stubbed: the storage is opened after Ray starts, and Ray is not
    what these cases are about."""

    device, use_gpu, slots, gpus_per_trial = "cpu", False, 1, 1
    describe = "no Ray (the campaign's stub)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def cap_slots(self, trials: int) -> None:
        pass

    def wait_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


READERS = {"status": ["status"], "status --json": ["status", "--json"], "status --study": ["status", "--study", STUDY],
           "status --trial": ["status", "--study", STUDY, "--trial", "12", "--json"], "db current": ["db", "current"]}
WRITERS = {"db upgrade": ["db", "upgrade"], "export": ["export", "--study", STUDY, "--json"], "start": ["start"]}


ISSUE_CASES = ("as stored", "file: other application", "file: empty", "file: text", "file: plain optuna study",
               "dropped trial_user_attributes", "two version rows (0001)", "revision '9999_future'",
               "revision '0002'", "study max_ne_gap = '\"x\"'", "trial 12 gain_vs_graph = '[]'")
"""The issue's own storages, each under every command."""
_STATUS = ("status", "status --json", "status --study", "status --trial")
REFUSED_BY = {
    **{name: (*_STATUS, "db current") for name in ("file: other application", "file: empty", "file: text",
                                                     "dropped trial_user_attributes")},
    **{name: _STATUS for name in ("file: plain optuna study", "study max_ne_gap = '\"x\"'",
                                  "trial 12 gain_vs_graph = '[]'")},
    "two version rows (0001)": ("status", "status --json", "db current"),
    "revision '9999_future'": ("status", "status --json"), "revision '0002'": ("status", "status --json"),
}
"""The readers each of the issue's storages must be refused by (``status --study`` shows a study
whose job row it cannot read as a study without a job; ``db current`` shows any revision)."""
STORAGE_SAMPLE = 40
"""Further (storage, command) pairs drawn from the rest of the product."""


def test_storage(campaign: Campaign, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    import erase_tune.tune.run.job as job
    from erase_tune.errors import EraseTuneError

    def stop_at_the_loop(*args: Any, **kwargs: Any) -> Any:
        raise EraseTuneError("<the campaign stops start at its trial loop>")

    monkeypatch.setattr(job, "RayExecutor", _NoRay)
    monkeypatch.setattr(job, "_prepare_loop", stop_at_the_loop)
    mutations = storage_mutations()
    commands = {**READERS, **WRITERS, "report": ["report", "--study", STUDY]}
    rng = random.Random(30)
    rest = [(m, c) for m in mutations for c in commands if m not in ISSUE_CASES]
    issue = [c for c in commands if c not in ("status --json", "report")]  # the same reads as status, report
    pairs = [(m, c) for m in ISSUE_CASES for c in issue] + rng.sample(rest, STORAGE_SAMPLE)
    for name, command in pairs:
        if command == "report" and not name.startswith(("file:", "dropped study", "dropped trial", "dropped version")):
            command = "status --study"  # a report that passes draws figures for seconds: only where it stops early
        _storage_case(campaign, world, name, mutations[name], command, commands[command])
    campaign.report("storage", 115)


def _storage_case(campaign: Campaign, world: World, name: str, mutate: Any, command: str, argv: list[Any]) -> None:
    d = world.fresh_dir("st")
    path = world.copy(d)
    mutate(path)
    if path.exists() and path.stat().st_size and not name.startswith("file: text"):
        with contextlib.suppress(sqlite3.DatabaseError):
            checkpoint(path)
    argv = [*argv, "--storage", f"sqlite:///{path}"]
    if command == "export":
        argv += ["-o", d / "best.yaml", "--ray-address", f"127.0.0.1:{world.closed_port}"]
    elif command == "start":  # a new study beside the finished one: the storage opened, the job's row written
        argv += ["--space", world.space, "--study", "other", "--no-confirm"]
    elif command == "report":
        argv += ["-o", d / "report"]
    reader = command in READERS or command == "report"
    before_dir, before = sorted(os.listdir(d)), digest(path) if path.exists() else None
    rows = None if reader else stored_rows(path)
    r = ran(campaign, "storage", argv, note=f" (storage: {name})")
    where = f"{command} on a storage with {name}"
    if reader:  # byte for byte: no table, no WAL, no journal mode
        assert (digest(path) if path.exists() else None) == before, \
            f"{where}: exit {r.code}, and the storage changed ({r.line})"
    if reader or r.code != 0 and "the campaign stops" not in r.line:
        if not reader:  # a writer that refused: every row stored before is still there as it was
            assert _kept(rows, stored_rows(path)), f"{where}: exit {r.code}, and what was stored changed ({r.line})"
        wrote = "did not record the export" in r.line  # the plan is there, and the line says so
        left = sorted(p for p in os.listdir(d) if p not in before_dir and not p.startswith("report")
                      and not (command in WRITERS and p.endswith(".lock"))  # a writer's lock file stays, by design
                      and not (wrote and p == "best.yaml"))
        assert not left, f"{where}: exit {r.code}, and it left {left}"
    if r.code == 0 and "--json" in argv:
        json.loads(r.out)
    assert len(r.out) <= 4 * MAX_OUTPUT, f"{where}: {len(r.out)} bytes on stdout"
    if command in REFUSED_BY.get(name, ()):
        assert r.code == 2, f"{where}: exit {r.code}"
    if "the campaign stops" in r.line:
        campaign.outcomes["storage:start reached its loop"] += 1


class _Planned(Exception):
    """Raised by the stubbed storage where the loop stores a new trial's plan."""


def _planned(*args: Any) -> None:
    raise _Planned


MODE_SETS = ["[keep, detach]", "[keep, place]", "[keep, graph]", "[keep, place, detach, graph]",
             "[keep, detach, graph]"]


def test_resumed_with_other_modes(campaign: Campaign) -> None:
    """A study tuned over one space's modes, resumed with another's: the loop's proposal step
    (no Ray, no storage file) gives a plan, or one line; never Optuna's ValueError."""
    import types
    import warnings

    import optuna

    from erase_tune.errors import EraseTuneError
    from erase_tune.tune.run.loop import Loop
    from erase_tune.tune.search.checks import check_space
    from erase_tune.tune.search.space import SearchSpace

    bound = {m: check_space(SearchSpace.loads(TINY_SPACE.replace("max_streams: 1}", f"max_streams: 1, modes: {m}}}"),
                                              source=f"modes {m}.yaml")) for m in MODE_SETS}
    for (first, later), seed in itertools.product(itertools.product(MODE_SETS, MODE_SETS), (0, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(directions=["maximize", "minimize"], study_name="resumed",
                                        sampler=optuna.samplers.RandomSampler(seed=seed))
        for _ in range(3):  # the first job's trials
            trial = study.ask()
            bound[first].plan(trial)
            study.tell(trial, [0.1, 0.0])
        storage = types.SimpleNamespace(heartbeat=lambda _: None, set_user_attrs=_planned)
        loop = types.SimpleNamespace(storage=storage, recorder=types.SimpleNamespace(trial_id=lambda n: n),
                                     checked=bound[later], space=bound[later].space, study=study)
        with campaign.case("resume", f"tuned over {first}, resumed with {later}"):
            try:
                Loop._propose(loop, study.ask())
                raise AssertionError("the proposal stored nothing")
            except _Planned:  # the plan was made, and the loop went on to store it
                outcome = "proposed a plan"
            except EraseTuneError as e:
                one_line(str(e), f"resumed with {later}")
                assert "offers other choices" in str(e), str(e)
                outcome = "refused in one line"
        if first == later:
            assert outcome == "proposed a plan", f"{first} resumed with the same modes: {outcome}"
        campaign.outcomes[f"resume:{outcome}"] += 1
    campaign.report("resume", 50)


# -- the environment: full disks, closed pipes, ASCII terminals, a journal with nowhere to write ------------


NON_ASCII = ["\u00e9tude", "\u65e5\u672c\u8a9e", "\U0001f642 run", "e\u0301tude-\u05e9\u05dc\u05d5\u05dd"]


def test_environment(campaign: Campaign, world: World) -> None:
    d = world.fresh_dir("env")
    db = world.copy(d)
    url = f"sqlite:///{db}"
    before = digest(db)
    outputs = [["status", "--storage", url], ["status", "--storage", url, "--json"],
               ["status", "--study", STUDY, "--storage", url, "--trial", "12", "--json"],
               ["db", "current", "--storage", url], ["--help"], ["--version"], ["start", "--help"],
               ["export", "--help"],
               ["status", "--storage", url, "--study", "nope"]]
    for argv, where in itertools.product(outputs, ("/dev/full", "closed pipe")):
        if where == "/dev/full":
            sink = open("/dev/full", "w")  # noqa: SIM115 - closed below, what is left in it dropped
        else:
            read, write = os.pipe()
            os.close(read)
            sink = os.fdopen(write, "w")
        try:
            r = ran(campaign, "environment", argv, stdout=sink, codes=EXIT_CODES | {141}, note=f" (stdout: {where})")
        finally:
            with contextlib.suppress(OSError):
                sink.close()
        if "nope" in argv:
            assert r.code == 2 and "no study named 'nope'" in r.line, r.line
        elif where == "/dev/full":  # every command writes something: the failed write is its one line
            assert r.code == 2 and "cannot write the command's output: No space left on device" in r.line, r.line
        else:  # a reader that went away: silent, as any Unix tool
            assert r.code == 141 and not r.err.strip(), f"{argv}: exit {r.code}: {r.err[-500:]!r}"
    # A terminal that takes ASCII only, and names that are not
    for i, name in enumerate(NON_ASCII):
        sub = d / f"donn\u00e9es-{i}"
        sub.mkdir()
        path = world.copy(sub, name=f"{name}.db")
        _sql(f"UPDATE studies SET study_name = '{name}'", f"UPDATE et_jobs SET study_name = '{name}'")(path)
        u = f"sqlite:///{path}"
        for argv in (["status", "--storage", u], ["status", "--storage", u, "--json"],
                     ["status", "--study", name, "--storage", u, "--trial", "12"],
                     ["export", "--study", name, "--storage", u, "-o", sub / f"{name}.yaml", "--json",
                      "--ray-address", f"127.0.0.1:{world.closed_port}"],
                     ["status", "--study", name + "?", "--storage", u], ["db", "current", "--storage", u],
                     ["report", "--study", name + "?", "--storage", u, "-o", sub / f"{name}-report"]):
            out = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
            err = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
            r = ran(campaign, "environment", argv, stdout=out, stderr=err, note=" (PYTHONIOENCODING=ascii)")
            if name + "?" in argv:
                assert r.code == 2 and "no study named" in r.line, r.line
            else:
                assert r.code == 0, f"{argv}: exit {r.code}: {r.line}"
            if "--json" in argv and r.code == 0:
                json.loads(r.out)
    _full_disk(campaign, world, d)
    # A journal directory that cannot be written: start says so before anything
    (d / "afile").write_text("")
    for journal in (d / "afile" / "journal", Path("/proc/erase-tune-journal"), d / "afile"):
        r = ran(campaign, "environment", ["start", "--space", world.space, "--storage", f"sqlite:///{d}/new.db",
                                          "--ray-address", f"127.0.0.1:{world.closed_port}"],
                env={"ERASE_TUNE_JOURNAL_DIR": str(journal)})
        assert r.code == 2 and "$ERASE_TUNE_JOURNAL_DIR" in r.line, r.line
    assert digest(db) == before and not (d / "new.db").exists()
    campaign.report("environment", 45)


@contextlib.contextmanager
def tiny_disk(path: Path) -> Iterator[bool]:
    """A 64 KiB tmpfs at ``path`` (root with CAP_SYS_ADMIN, as in the dev container); False where
    it cannot be mounted (its cases are then left out)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True,
                             check=False).returncode == 0 if os.geteuid() == 0 and shutil.which("mount") else False
    try:
        yield mounted
    finally:
        if mounted:
            # (torch's profiler keeps the descriptor of a trace it failed to write: its own leak, gone
            # with the process, and the reason this unmount is lazy)
            held = [p for p in map(_fd_target, os.listdir("/proc/self/fd"))
                    if p.startswith(str(path)) and ".json.tmp" not in p]
            subprocess.run(["umount", "-l", str(path)], check=True)
            assert not held, f"files on the full disk left open: {held}"


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed already
        return ""


def _fill(disk: Path, leave: int) -> None:
    """Everything on ``disk`` removed, then a file that leaves ``leave`` bytes free."""
    for p in disk.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"x" * max(0, shutil.disk_usage(disk).free - leave))


def _full_disk(campaign: Campaign, world: World, d: Path) -> None:
    """Writes that fail for want of room on a real (tiny) file system: a redirected standard
    output (buffered, unlike /dev/full), export's plan, report's figures, bench's trace."""
    disk = d / "tiny-disk"
    with tiny_disk(disk) as mounted:
        if not mounted:
            return
        url = f"sqlite:///{world.copy(d, name='full.db')}"
        tiny = [a for k, v in TINY_ARGS.items() for a in ("--arg", f"{k}={v}")]
        for argv, leave in itertools.product(
                (["status", "--storage", url, "--json"], ["status", "--storage", url], ["--help"], ["--version"],
                 ["db", "current", "--storage", url]), (0, 100)):
            _fill(disk, leave)
            with open(disk / "out.txt", "w") as out:
                r = ran(campaign, "environment", argv, stdout=out, note=f" (stdout on a full disk, {leave} B free)")
            assert r.code == 2 and "No space left on device" in r.line, r.line
        for argv in (["export", "--study", STUDY, "--storage", url, "-o", disk / "best.yaml"],
                     ["report", "--study", STUDY, "--storage", url, "-o", disk / "report"],
                     ["bench", "--workload", "ctr", *tiny, "--device", "cpu", *BUDGET, "--trace", disk / "trace"]):
            _fill(disk, 2000)
            r = ran(campaign, "environment", argv, note=" (its output on a full disk)")
            assert r.code == 2 and ("No space left on device" in r.line or "full disk" in r.line), r.line
        _fill(disk, 0)


# -- waits: a locked storage, services that are not what the address says ----------------------------------

HOLD = """
import fcntl, os, sqlite3, sys
if sys.argv[1] == "flock":
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    c = sqlite3.connect(sys.argv[2], isolation_level=None)
    c.execute("BEGIN EXCLUSIVE")
    c.execute("CREATE TABLE held (x)")
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def held(kind: str, path: Path) -> Iterator[None]:
    """Another process holding ``path``: an exclusive transaction, or its schema lock file."""
    target = path if kind == "transaction" else path.with_name(
        f"{path.name}.{hashlib.sha256(b'schema').hexdigest()[:8]}.lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, "flock" if kind == "schema lock" else "sql", str(target)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _said_within(r: Ran, seconds: float) -> None:
    """The wait was said (a line other than the error, saying how long it waits) within ``seconds``."""
    said = [(t, text) for t, text in r.stamps if "error:" not in text and ("waiting" in text or "retrying" in text)]
    assert said and said[0][0] <= seconds, f"the wait was not said within {seconds}s: {r.stamps}"


def test_waits(campaign: Campaign, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    import erase_tune.tune.run.job as job
    from erase_tune.errors import EraseTuneError

    def stop_at_the_loop(*args: Any, **kwargs: Any) -> Any:
        raise EraseTuneError("<the campaign stops start at its trial loop>")

    monkeypatch.setattr(job, "RayExecutor", _NoRay)
    monkeypatch.setattr(job, "_prepare_loop", stop_at_the_loop)
    d = world.fresh_dir("waits")
    closed = f"127.0.0.1:{world.closed_port}"
    commands = {"status": ["status"], "db current": ["db", "current"], "db upgrade": ["db", "upgrade"],
                "export": ["export", "--study", STUDY, "-o", d / "best.yaml", "--ray-address", closed],
                "start": ["start", "--space", world.space, "--study", "other", "--no-confirm"]}
    for kind in ("transaction", "schema lock"):
        path = world.copy(world.fresh_dir("locked"))
        with held(kind, path):
            for i, (name, argv) in enumerate(commands.items()):
                retry = "1.5" if i == 2 else "0.3"  # one case waits long enough to be heard saying so
                t0 = time.monotonic()
                r = ran(campaign, "waits", [*argv, "--storage", f"sqlite:///{path}"],
                        env={"ERASE_TUNE_STORAGE_RETRY_S": retry}, note=f" ({kind} held elsewhere, retry {retry}s)")
                took = time.monotonic() - t0
                assert took < float(retry) + 4, f"{name} with the {kind} held: {took:.1f}s for a retry of {retry}s"
                if r.code != 0 and "the campaign stops" not in r.line:
                    assert r.code in (2, 3) and ("locked" in r.line or "held its lock" in r.line), f"{name}: {r.line}"
                if retry == "1.5" and r.code != 0 and "the campaign stops" not in r.line:
                    _said_within(r, 2.0)
    listeners = world.listeners
    for kind, (name, argv) in itertools.product(("http", "garbage", "closer", "silent"),
                                                [("status", ["status"]), ("db upgrade", ["db", "upgrade"]),
                                                 ("start", ["start", "--space", world.space])]):
        if kind == "silent" and name != "status":
            continue  # each one waits the connect timeout out: once is proof enough
        url = f"postgresql+psycopg://erase:s3cret@127.0.0.1:{listeners[kind].port}/db"
        t0 = time.monotonic()
        r = ran(campaign, "waits", [*argv, "--storage", url], note=f" (PostgreSQL URL at a {kind} listener)")
        assert r.code == 2 and "cannot open" in r.line and "s3cret" not in r.err, r.line
        assert time.monotonic() - t0 < 6, f"{name} at a {kind} listener took {time.monotonic() - t0:.1f}s"
    unconfirmed = world.copy(world.fresh_dir("unconfirmed"))
    _sql("DELETE FROM et_confirmations", "DELETE FROM et_quality_confirmations")(unconfirmed)
    for kind, how in itertools.product(("http", "garbage", "closer", "silent"), ("option", "ray://", "environment")):
        if kind == "silent" and how != "option":
            continue
        address = f"127.0.0.1:{listeners[kind].port}"
        argv = ["export", "--study", STUDY, "--storage", f"sqlite:///{unconfirmed}", "-o", d / "best.yaml"]
        env = None
        if how == "environment":
            env = {"RAY_ADDRESS": address}
        else:
            argv += ["--ray-address", ("ray://" if how == "ray://" else "") + address]
        t0 = time.monotonic()
        r = ran(campaign, "waits", argv, env=env, note=f" (Ray address at a {kind} listener, {how})")
        assert r.code == 2 and "it is not Ray" in r.line, r.line
        assert time.monotonic() - t0 < 5
    campaign.report("waits", 30)
