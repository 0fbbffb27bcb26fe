"""Property-based proof that hostile or careless input ends in a correct run or one line.

erase-tune's rule for anything a user gives it (plan files, search-space files, workload
arguments, command lines): a correct run, or ONE line naming the problem (an
``EraseTuneError``; the CLI prints ``erase-tune: error: ...`` and exits 2), never a
traceback, within bounded time and memory, and nothing already stored is lost. Fuzzing
found many ways around that rule once (a 30-byte plan listing 10^11 names, a trillion
streams, recursive aliases, 5000-digit integers, ...); this module generates such input
instead of listing it, so the next one is found here rather than by a user.

- Plans: YAML documents from a grammar close to the plan schema (valid values and, per
  field, values the schema must refuse), YAML-only shapes (huge integers, deep nesting,
  anchors and recursive aliases, tags) and raw text edits. A plan that loads must survive
  ``dumps``/``loads``, be checked against a small real model, and then either be refused by
  the engine's probe in one line or train one step on the CPU.
- Spaces: the same around a tiny CTR workload. A space that loads and passes
  ``check_space`` must propose plans (its seeds first) that are valid plans of the model.
- Command lines: argv lists for every subcommand, mixing valid and invalid values, run
  in-process through ``erase_tune.cli.main``. No case can start a long job: storage is a
  temporary SQLite file, every ``--ray-address`` is refused before Ray starts, workloads
  and budgets are tiny, the dashboard only ever gets a port it cannot bind.

Every case must end within :data:`CASE_SECONDS`, every error message is one printable line
of bounded length, and the process's peak RSS (``ru_maxrss``, which sees torch's
allocations too) may grow by at most :data:`RSS_GROWTH_BYTES` over the whole run. Each
area asserts a floor on its case count, so the module always runs at least 2,000 cases.
The profile is derandomized: CI runs the same cases every time.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import logging
import math
import os
import resource
import signal
import socket
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from erase_tune.cli import main
from erase_tune.errors import EraseTuneError, PlanError
from erase_tune.runtime import EraseEngine, ErasePlan
from erase_tune.store import ConfirmationRecord, QualityRecord
from erase_tune.runtime.probing import probe
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.space import SearchSpace, SpaceError
from erase_tune.tune.search.study import make_sampler
from erase_tune.workloads import get_workload
from tests.hostile_inputs import (
    CTR_NAMES,
    CTR_RUNS,
    TINY_CTR,
    Doc,
    emit,
    odd_text,
    one_in,
    plan_docs,
    space_docs,
)
from tests.runtime.models import Toy, loss_fn, toy_batch

CASE_SECONDS = 5.0
"""Most CPU time (this process's) any single case may take: a correct tiny trial takes about
one second. CPU time, not wall time: beside two CPU burners a 1 s case took 6.8 s of wall time,
other processes' turns; a case that waits instead of computing is caught by ``HUNG_SECONDS``."""
SLOW_CASE_SECONDS = {"command lines": 20.0}
"""Areas with a longer bound: a command line may render a report's figures (matplotlib takes
several seconds on two loaded cores); still far below a hang."""
RSS_GROWTH_BYTES = 500 * 2**20
"""Most the process's peak resident memory may grow over the whole module."""
MAX_MESSAGE = 1000
"""Longest error line: enough for a path and a field list, short of flooding a terminal."""
HUNG_SECONDS = 30
"""A case still running after this is interrupted (and fails): a hang must not hang CI."""

PLAN_CASES, SPACE_CASES, CLI_CASES = 1000, 450, 600
"""Cases per area (explicit examples come on top); together over 2,000."""


def profile(n: int) -> settings:
    """``n`` cases, the same ones on every run; the time bound is our own (per case, below)."""
    return settings(derandomize=True, database=None, max_examples=n, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example, HealthCheck.filter_too_much])


# -- bounds ------------------------------------------------------------------------------------


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _Hung(BaseException):
    """Raised by the watchdog in a case that ran past HUNG_SECONDS (BaseException: no
    ``except Exception`` in the code under test may swallow it)."""


class Bounds:
    """Per-case wall time, case counts per area and the RSS high-water mark of the run."""

    def __init__(self, write_line: Any) -> None:
        self.write_line = write_line
        self.rss0 = _max_rss()
        self.cases: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.slowest: dict[str, tuple[float, str]] = {}
        self.started = time.monotonic()

    @contextlib.contextmanager
    def case(self, area: str, label: str) -> Iterator[None]:
        def hung(signum: int, frame: Any) -> None:
            raise _Hung(f"{area} case still running after {HUNG_SECONDS}s: {label}")

        old = signal.signal(signal.SIGALRM, hung)
        signal.setitimer(signal.ITIMER_REAL, HUNG_SECONDS)
        t0 = time.process_time()
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        elapsed = time.process_time() - t0
        self.cases[area] += 1
        if elapsed > self.slowest.get(area, (0.0, ""))[0]:
            self.slowest[area] = (elapsed, label)
        limit = SLOW_CASE_SECONDS.get(area, CASE_SECONDS)
        assert elapsed < limit, f"{area} case took {elapsed:.1f}s of CPU (limit {limit}s): {label}"
        grown = _max_rss() - self.rss0
        assert grown < RSS_GROWTH_BYTES, f"peak RSS grew by {grown / 2**20:.0f} MiB after {area} case: {label}"

    def report(self, area: str, floor: int) -> None:
        grown = (_max_rss() - self.rss0) / 2**20
        slow, label = self.slowest.get(area, (0.0, ""))
        outcomes = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in sorted(self.outcomes.items())
                             if k.startswith(area + ":"))
        line = (f"hostile {area}: {self.cases[area]} cases ({outcomes}); slowest {slow:.2f}s ({label[:60]!r}); "
                f"peak RSS +{grown:.0f} MiB; {time.monotonic() - self.started:.0f}s since the first case")
        self.write_line(line)
        assert self.cases[area] >= floor, f"only {self.cases[area]} {area} cases ran (want >= {floor})"


def _say(config: pytest.Config, line: str) -> None:
    """Write ``line`` to the terminal, past pytest's capture (the counts show without -s)."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line(line) if reporter else print(line)


@pytest.fixture(scope="module")
def bounds(pytestconfig: pytest.Config) -> Iterator[Bounds]:
    # Everything the cases import is imported first, so the RSS baseline is not the imports.
    import ray  # noqa: F401

    import erase_tune.measure.bench
    import erase_tune.tune.views.figures
    import erase_tune.tune.views.html_report
    import erase_tune.tune.run.job
    import erase_tune.tune.run.remote  # noqa: F401

    # The first figure a process draws loads matplotlib's fonts (seconds on a loaded machine):
    # done here, so a report case is timed for the report, not for the fonts.
    from matplotlib.figure import Figure

    Figure().savefig(io.BytesIO(), format="png")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only contend, 7x slower here
    try:
        yield Bounds(functools.partial(_say, pytestconfig))
    finally:
        torch.set_num_threads(threads)


def one_line(message: str, where: str) -> str:
    """Check that an error message is one printable, bounded line; return it."""
    assert message, f"{where}: empty error message"
    assert "\n" not in message and "\r" not in message, f"{where}: message of several lines: {message[:300]!r}"
    assert message.isprintable(), f"{where}: raw control or unprintable character in message: {message[:300]!r}"
    assert len(message) <= MAX_MESSAGE, f"{where}: message of {len(message)} characters: {message[:200]!r}…"
    return message


def _label(text: str) -> str:
    return repr(text[:120]) + (f"… ({len(text)} chars)" if len(text) > 120 else "")


# -- plans ---------------------------------------------------------------------------------------

LAUGHS = "provenance:\n" + "\n".join(
    ["  l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)])


def run_plan(text: str) -> str:
    """Load, check and run one plan text; returns how it ended."""
    try:
        plan = ErasePlan.loads(text, source="hostile.yaml")
    except EraseTuneError as e:
        assert str(e).startswith("hostile.yaml: "), str(e)[:300]
        one_line(str(e), "ErasePlan.loads")
        return "refused"
    assert ErasePlan.loads(plan.dumps(), source="dumped") == plan, "dumps() does not load back to the same plan"
    canonical = plan.canonical()
    assert canonical.canonical() == canonical
    assert "\n" not in plan.describe()
    model = Toy()
    try:
        plan.check_model(model)
    except PlanError as e:
        one_line(str(e), "check_model")
        return "not in the model"
    x, y = toy_batch(8)
    try:
        engine = EraseEngine(model, plan, loss_fn=loss_fn, example=(x, y))
    except PlanError as e:
        one_line(str(e), "EraseEngine")
        return "refused by the probe"
    with engine:
        loss = engine.step(x, y)
    assert torch.isfinite(loss), f"a checked plan trained to a non-finite loss {loss}"
    return "trained a step"


def test_hostile_plans(bounds: Bounds) -> None:
    @profile(PLAN_CASES)
    @given(doc=plan_docs())
    @example(doc=Doc("cuts: [layers.0:100000000000]", "bad", "a run of 10^11 blocks"))
    @example(doc=Doc("cuts: [" + ", ".join(f"l{i}.0:20000" for i in range(1000)) + ", l999.19999:20000]", "bad",
                     "1001 runs of 20,000 blocks, the last two overlapping"))
    @example(doc=Doc("cuts: [" + ", ".join(f"layers.{i * 100_000}:{(i + 1) * 100_000}" for i in range(1024)) + "]",
                     "any", "1024 disjoint runs of 100,000 blocks"))
    @example(doc=Doc("num_streams: 1000000000000", "bad", "a trillion streams"))
    @example(doc=Doc("num_streams: 2\ncuts: [{module: towers.0, stream: 99999999999999999999999}]", "bad", "stream"))
    @example(doc=Doc("cuts: " + "[" * 500 + "]" * 500, "bad", "500 levels of nesting"))
    @example(doc=Doc("num_streams: " + "9" * 5000, "bad", "a 5000-digit integer"))
    @example(doc=Doc("cuts: [{module: towers.0, aux_weight: " + "9" * 4300 + "}]", "bad", "a 4300-digit weight"))
    @example(doc=Doc("cuts: [{module: towers.0, aux_weight: 0x" + "f" * 5000 + "}]", "bad", "a 20000-bit weight"))
    @example(doc=Doc("objectives: 5", "bad", "a space field in a plan"))
    @example(doc=Doc("seeds: 5", "bad", "a space field in a plan"))
    @example(doc=Doc("cuts: 5", "bad", "cuts"))
    @example(doc=Doc("cuts: 0", "bad", "cuts"))
    @example(doc=Doc("version: 1.0", "bad", "a float version"))
    @example(doc=Doc("{1: a, b: c}", "bad", "mixed-type keys"))
    @example(doc=Doc("cuts: [{module: towers.0, [1]: 2}]", "bad", "a list as a key"))
    @example(doc=Doc("provenance: &a [*a]", "bad", "a recursive alias"))
    @example(doc=Doc("provenance: &a {x: *a}", "bad", "a recursive mapping alias"))
    @example(doc=Doc("cuts: &a [*a]", "bad", "a recursive alias in cuts"))
    @example(doc=Doc(LAUGHS, "bad", "a billion laughs"))
    @example(doc=Doc('dispatch: "fast\\nslow\\u001b[2J"', "bad", "control characters"))
    @example(doc=Doc('"bo\\u0007gus": 1', "bad", "a control character in a key"))
    @example(doc=Doc('cuts: ["towers.0\\u202e"]', "bad", "a bidi override in a name"))
    @example(doc=Doc('cuts: ["towers\\u200b.0"]', "bad", "a zero-width space in a name"))
    @example(doc=Doc("cuts: [blöcks.0]", "any", "a unicode name"))
    @example(doc=Doc("provenance: {a: 2020-01-01}", "bad", "a date in provenance"))
    @example(doc=Doc("cuts: !!python/object/apply:os.system ['true']", "bad", "a python tag"))
    @example(doc=Doc("cuts: [" + "a" * 100_000 + "!]", "bad", "a 100 kB module name"))
    @example(doc=Doc("#" * (1 << 20) + "\n", "bad", "more than 1 MiB"))
    @example(doc=Doc("num_streams: 2\ndispatch: threaded\ncuts: [{module: towers.0, stream: 1, aux_weight: 0.5}, "
                     "blocks.0:2]\nplacements: [{module: towers.1, stream: 2}]\n", "any", "a good plan"))
    def case(doc: Doc) -> None:
        with bounds.case("plans", _label(doc.text)):
            outcome = run_plan(doc.text)
        bounds.outcomes[f"plans:{outcome}"] += 1
        if doc.expect == "bad":
            assert outcome == "refused", f"accepted a plan the schema must refuse ({doc.why}): {_label(doc.text)}"

    case()
    bounds.report("plans", PLAN_CASES)


# -- search spaces -------------------------------------------------------------------------------

CTR_ARGS = "{" + ", ".join(f"{k}: {v}" for k, v in TINY_CTR.items()) + "}"
SPACE = f"workload: {{name: ctr, args: {CTR_ARGS}}}\n"


def run_space(text: str) -> str:
    """Load and check one space; if it passes, sample plans from it and check them."""
    try:
        space = SearchSpace.loads(text, source="hostile-space.yaml")
    except SpaceError as e:
        assert str(e).startswith("hostile-space.yaml: "), str(e)[:300]
        one_line(str(e), "SearchSpace.loads")
        return "refused"
    try:
        checked = check_space(space)
    except EraseTuneError as e:
        one_line(str(e), "check_space")
        return "refused by the model"
    workload = get_workload(space.workload.name, space.workload.args)
    model = workload.build_model()
    inputs, _ = workload.example(torch.device("cpu"))
    found = probe(model, tuple(inputs), checked.candidates)
    with warnings.catch_warnings():  # TPE's grouped mode is "experimental": erase-tune uses it on purpose
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(directions=["maximize", "minimize"],
                                    sampler=make_sampler(space.sampler.name, space.sampler.seed))
    for _, params in checked.seeds:
        study.enqueue_trial(params)
    for i in range(len(checked.seeds) + 3):
        trial = study.ask()
        plan = checked.plan(trial)
        assert plan == plan.canonical()
        assert {t.module for t in (*plan.cuts, *plan.placements)} <= set(checked.candidates)
        plan.check_model(model)
        found.check_plan(plan)  # a proposed plan starves no parameter and keeps the output's gradient
        if i < len(space.seeds):
            assert plan == space.seeds[i].plan, f"seed {space.seeds[i].name!r} came back as another plan"
        study.tell(trial, [0.0, 0.0])
    return "proposed valid plans"


def test_hostile_spaces(bounds: Bounds) -> None:
    @profile(SPACE_CASES)
    @given(doc=space_docs())
    @example(doc=Doc(SPACE + "objectives: 5", "bad", "objectives"))
    @example(doc=Doc(SPACE + "seeds: 5", "bad", "seeds"))
    @example(doc=Doc(SPACE + "seeds: 0", "bad", "seeds"))
    @example(doc=Doc(SPACE + "budget: 0", "bad", "budget"))
    @example(doc=Doc(SPACE + "cuts: false", "bad", "cuts"))
    @example(doc=Doc(SPACE + "seeds: [{plan: 0}]", "bad", "a seed plan"))
    @example(doc=Doc("workload: {name: ctr, args: 0}", "bad", "workload.args"))
    @example(doc=Doc(SPACE.replace("rows: 10", "rows: 1000000000000"), "bad", "rows"))
    @example(doc=Doc(SPACE.replace("batch: 16", "batch: 1000000000000"), "bad", "batch"))
    @example(doc=Doc(SPACE.replace("batch: 16", "lr: " + "9" * 400 + ", batch: 16"), "bad", "lr"))
    @example(doc=Doc(SPACE + "sampler: {name: tpe, seed: 1099511627776}", "bad", "sampler seed 2^40"))
    @example(doc=Doc(SPACE + "cuts: {max_streams: 1000000000000}", "bad", "max_streams"))
    @example(doc=Doc(SPACE + "cuts: {modes: [0x" + "f" * 5000 + "]}", "bad", "a 20000-bit mode"))
    @example(doc=Doc(SPACE + "trials: " + "9" * 5000, "bad", "a 5000-digit integer"))
    @example(doc=Doc(SPACE + "seeds: " + "[" * 500 + "]" * 500, "bad", "500 levels of nesting"))
    @example(doc=Doc(SPACE + "3: x", "bad", "mixed-type keys"))
    @example(doc=Doc(SPACE + "seeds: [{name: s, plan: {provenance: &a [*a]}}]", "bad", "a recursive alias"))
    @example(doc=Doc(SPACE + 'seeds: [{name: "two\\nlines\\u001b[2J", plan: {cuts: [over]}}]', "bad",
                     "a control character in a failing seed's name"))
    @example(doc=Doc(SPACE + "device: " + "x" * 100_000, "bad", "a 100 kB value"))
    @example(doc=Doc(f'workload: {{name: ctr, args: {CTR_ARGS}, working_dir: "a\\0b"}}', "bad", "a NUL in a path"))
    @example(doc=Doc(f"workload: {{name: ctr, args: {CTR_ARGS}, py_modules: [null]}}", "bad", "py_modules"))
    @example(doc=Doc(SPACE + "cuts: {candidates: [subarchs.0, subarchs.1], max_streams: 2, dispatch: [blocking, "
                     "threaded, deferred], aux_weight: {low: 0.1, high: 2, log: true}}\nsampler: {name: tpe, seed: 4294967295}"
                     "\nseeds: [{name: all, plan: {num_streams: 2, cuts: [{module: subarchs.0, stream: 1}]}}]",
                     "any", "a good space"))
    def case(doc: Doc) -> None:
        with bounds.case("spaces", _label(doc.text)):
            outcome = run_space(doc.text)
        bounds.outcomes[f"spaces:{outcome}"] += 1
        if doc.expect == "bad":
            assert outcome.startswith("refused"), f"accepted a space that must be refused ({doc.why}): {_label(doc.text)}"

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per study created
    try:
        case()
    finally:
        optuna.logging.set_verbosity(verbosity)
    bounds.report("spaces", SPACE_CASES)


# -- command lines -------------------------------------------------------------------------------

FRESH_DB, FRESH_FILE, FRESH_DIR = "<fresh-db>", "<fresh-file>", "<fresh-dir>"
"""Placeholders in generated argv, replaced per case by a path nothing has used yet, so a
case can check that a refused command wrote nothing there."""
EXIT_CODES = {0, 1, 2, 3, 130}
COMMAND_NAMES = ("trial", "bench", "start", "status", "export", "report", "dashboard", "db")


class CliWorld:
    """Files and finished studies the command lines point at; built once per run."""

    def __init__(self, root: Path) -> None:
        from erase_tune.store.storage import open_storage
        from tests.tune.studies import FRONT, STUDY_NAME, write_finished_study

        self.root = root
        self.counter = 0
        self.plan = root / "plan.yaml"
        self.plan.write_text("cuts: [subarchs.0]\n")
        self.space = root / "space.yaml"
        self.space.write_text(SPACE + "cuts: {candidates: [subarchs.0, subarchs.1], max_streams: 1}\n"
                              "sampler: {name: random, seed: 0}\n"
                              "budget: {warmup_steps: 5, windows: 1, max_windows: 1, window_steps: 1, timeout_s: 30}\n"
                              "trials: 1\ndevice: cpu\n")
        self.hostile_plans = self._write("bad-plan", [
            "cuts: [layers.0:100000000000]", "num_streams: 1000000000000", "cuts: " + "[" * 500 + "]" * 500,
            "num_streams: " + "9" * 5000, "{1: a, b: c}", "provenance: &a [*a]", 'dispatch: "a\\nb"', "cuts: [towers.7]",
            "cuts: [subarchs.0, subarchs.0]", "", "\x00", "dispatch: \udcff", "cuts: [over]"])
        self.hostile_spaces = self._write("bad-space", [
            SPACE + "objectives: 5", SPACE + "seeds: 5", SPACE.replace("rows: 10", "rows: 1000000000000"),
            SPACE + "sampler: {name: tpe, seed: 1099511627776}", SPACE + "cuts: {max_streams: 1000000000000}",
            "workload: " + "[" * 500 + "]" * 500, SPACE + "trials: " + "9" * 5000, "{1: a, workload: ctr}",
            SPACE + "seeds: [{name: s, plan: {provenance: &a {x: *a}}}]", SPACE + "cuts: {candidates: [nope]}"])
        self.fifo = root / "fifo.yaml"  # opening it for reading blocks until a writer comes: none ever does
        os.mkfifo(self.fifo)
        self.readonly = root / "readonly"
        self.readonly.mkdir()
        self.existing = root / "existing.yaml"
        self.existing.write_text("# an earlier export\n")
        # Two finished jobs with their fronts confirmed (speed and quality), so export runs without Ray: in one
        # every front plan shows a gain (export writes it), in the other none does (exit 1).
        self.url = write_finished_study(root / "finished.db", gain_over="eager")
        write_finished_study(root / "finished.db", gain_over="eager", study_name="no-gain")
        self.study, self.studies = STUDY_NAME, (STUDY_NAME, "no-gain")
        db = open_storage(self.url)
        try:
            for name, low in ((STUDY_NAME, 0.05), ("no-gain", -0.1)):
                job = db.store.create_job(study_name=name, space_path=str(self.space),
                                          space_yaml=self.space.read_text(), workload="ctr", n_trials_target=18)
                db.store.set_job_status(name, "finished")
                study = optuna.load_study(study_name=name, storage=db.optuna)
                for n in FRONT:
                    plan = ErasePlan.from_dict(study.trials[n].user_attrs["plan"])
                    db.store.record_confirmation(job, n, ConfirmationRecord(
                        plan_yaml=plan.dumps(), gain_over="eager", windows=5, gain=low + 0.05, gain_lo=low,
                        gain_hi=low + 0.1, samples={}, provenance={}))
                    db.store.record_quality(job, n, QualityRecord(
                        plan_yaml=plan.dumps(), steps=100, seeds=3, ne_gap=0.001, ne_gap_lo=-0.002, ne_gap_hi=0.004,
                        per_seed=[0.0, 0.001, 0.002], exact=not plan.cuts, band=0.002, provenance={}))
        finally:
            db.close()
        self.readonly.chmod(0o555)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            self.closed_port = s.getsockname()[1]
        self.busy = socket.socket()  # a port the dashboard cannot bind: it never serves
        self.busy.bind(("0.0.0.0", 0))
        self.busy.listen()
        self.busy_port = self.busy.getsockname()[1]

    def _write(self, stem: str, texts: list[str]) -> list[Path]:
        paths = []
        for i, text in enumerate(texts):
            path = self.root / f"{stem}-{i}.yaml"
            path.write_bytes(text.encode("utf-8", "surrogatepass"))
            paths.append(path)
        return paths

    def fresh(self, kind: str) -> Path:
        self.counter += 1
        return self.root / f"fresh-{self.counter}{'.db' if kind == FRESH_DB else '.yaml' if kind == FRESH_FILE else ''}"

    def snapshot(self) -> dict:
        """Everything stored for the finished jobs: it must never change."""
        from erase_tune.store.storage import open_storage

        db = open_storage(self.url, must_exist=True, upgrade=False)
        try:
            out = {}
            for name in self.studies:
                trials = optuna.load_study(study_name=name, storage=db.optuna).get_trials()
                job = db.store.get_job(name)
                out[name] = {"trials": [(t.number, t.state, t.values, t.params, t.user_attrs) for t in trials],
                             "job": (job.id, job.status, job.space_yaml, job.n_trials_target),
                             "confirmations": [(c.trial_number, c.windows, c.gain) for c in db.store.confirmations(job)]}
            return out
        finally:
            db.close()


def command_lines(w: CliWorld) -> st.SearchStrategy[list[str]]:
    """argv lists for every subcommand: valid values mixed with refused ones.

    Each value is drawn from its valid pool and, about one time in five, from a pool the
    command must refuse (odds kept per value, so about a third of the cases get past the
    arguments to a correct run or to what the library refuses)."""

    def usual(good: Any, bad: Any, odds: int = 5) -> st.SearchStrategy[Any]:
        good = good if isinstance(good, st.SearchStrategy) else st.sampled_from(good)
        bad = bad if isinstance(bad, st.SearchStrategy) else st.sampled_from(bad)
        return one_in(odds).flatmap(lambda b: bad if b else good)

    def maybe(flag: str, values: st.SearchStrategy[str], odds: int = 3) -> st.SearchStrategy[list[str]]:
        """``[flag, value]``, or nothing one time in ``odds``."""
        return st.tuples(one_in(odds), values).map(lambda t: [] if t[0] else [flag, t[1]])

    def flag(name: str) -> st.SearchStrategy[list[str]]:
        return st.booleans().map(lambda on: [name] if on else [])

    # Each refused before Ray starts: nothing listens, or it is not an address at all. (Not
    # "auto", which joins whatever cluster runs on this machine.)
    refused_ray = usual([f"127.0.0.1:{w.closed_port}", f"ray://127.0.0.1:{w.closed_port}"],
                        ["127.0.0.1:0", "garbage", "", " ", "a:b", ":", "127.0.0.1:", "127.0.0.1:99999999", "\x1b[2J:1",
                         f"127.0.0.1:{w.closed_port}\n", "ray:/", "ray://", "127.0.0.1:-1", "x" * 10_000,
                         "127.0.0.1:" + "9" * 5000, "ray://127.0.0.1:" + "9" * 5000], odds=3)
    storage = usual([f"sqlite:///{w.root / 'finished.db'}", FRESH_DB],
                    ["", " ", "garbage", "sqlite://", "sqlite:///", "sqlite:///:memory:",
                     f"sqlite:///{w.root}/no/such/dir/x.db", f"sqlite:///{w.root}", f"sqlite:///{w.plan}",
                     f"sqlite:///{w.root}/a\x00b.db", "postgresql+psycopg://user:s3cret@127.0.0.1:1/x",
                     "mysql://user:s3cret@127.0.0.1:1/x", "x" * 10_000, "sqlite:///\x1b[2J", "postgresql://" + "a" * 5000,
                     "sqlite:///" + "a/" * 3000 + "x.db"])
    study = usual(list(w.studies), st.one_of(st.sampled_from(["nope", "", " ", "\x1b[2J", "a\nb", "x" * 10_000]), odd_text(1)))
    bad_ints = ["-1", "0", "1000000000000", "9" * 5000, "x", "", "1e3", "nan", "0x10", " 5"]
    bad_floats = ["-1", "nan", "inf", "-inf", "1e308", "1e999", "x", ""]
    devices = ["garbage", "meta", "cuda:99999999999999999999", "", "cpu:0", "x" * 10_000]
    if not torch.cuda.is_available():
        devices.append("cuda")  # refused here; on a GPU machine it would run on the GPU
    # Smaller still than the spaces' workload: a correct trial here takes a third of a second.
    ctr_args = [a for k, v in {**TINY_CTR, "width": 8, "depth": 1, "emb_dim": 4, "sub_out": 4, "eval_batches": 1}.items()
                for a in ("--arg", f"{k}={v}")]
    bad_args = st.sampled_from(["rows=1000000000000", "batch=1000000000000", "rows=" + "9" * 5000, "lr=" + "9" * 400,
                                "base_rate=" + "9" * 400, "nokey", "=5", "bogus=1", "rows=" + "[" * 600,
                                "batch=abc", "a\x00b=1", "data=/etc/passwd", "rows=&a [*a]", "lr=.nan", "rows=-1",
                                "batch=0x" + "f" * 5000, "seed=1099511627776", "width=1000000", "depth=1000000000",
                                "batch=" + "x" * 100_000, "x" * 10_000 + "=1"])

    @st.composite
    def written(draw: Any, docs: st.SearchStrategy[Any]) -> str:
        """A generated plan or space document, written to a file of its own."""
        path = w.fresh(FRESH_FILE)
        path.write_bytes(draw(docs).text.encode("utf-8", "surrogatepass"))
        return str(path)

    plan_file = usual(st.one_of(st.just(str(w.plan)), written(plan_docs(CTR_NAMES, CTR_RUNS))),
                      [*map(str, w.hostile_plans), str(w.root / "missing.yaml"), str(w.root), "", "a\x00b", "/dev/zero", str(w.fifo),
                       "x" * 300])
    space_file = usual(st.one_of(st.just(str(w.space)), written(space_docs())),
                       [*map(str, w.hostile_spaces), str(w.root / "missing.yaml"), str(w.root), "", "a\x00b", "x" * 300,
                        str(w.fifo)])

    @st.composite
    def workload(draw: Any) -> list[str]:
        name = draw(usual(["ctr"], ["", "nosuch", "nosuch_pkg.mod:make", "gpt", "mlp", "ctr\n", "x" * 10_000], odds=6))
        args = list(ctr_args)
        if draw(one_in(5)):
            args += ["--arg", draw(bad_args)]
        if name in ("gpt", "mlp"):  # at their defaults they train for long: always one refused argument
            args = ["--arg", "batch=1000000000000"]
        return ["--workload", name, *args, "--device", draw(usual(["cpu"], devices, odds=6))]

    budget = st.tuples(
        st.sampled_from([["--warmup", "5", "--windows", "1", "--window-steps", "1"],
                         ["--warmup", "6", "--windows", "1", "--window-steps", "2"]]),
        usual(st.just([]), st.tuples(st.sampled_from(["--warmup", "--windows", "--window-steps", "--seed"]),
                                     st.sampled_from(bad_ints)).map(list), odds=6),
    ).map(lambda t: t[0] + t[1])

    trial = st.tuples(st.just(["trial"]), workload(), plan_file.map(lambda p: ["--plan", p]), budget,
                      maybe("--quality-steps", usual(["0", "2"], bad_ints)), flag("--json"))
    bench = st.tuples(st.just(["bench"]), workload(), budget,
                      maybe("--cuts", usual(["subarchs.0", "subarchs.0,subarchs.1"],
                                            [",,,", "", "subarchs.9", "x.0:100000000000", "a\nb", "over",
                                             "subarchs.0,subarchs.0", "subarchs.0:2", "x" * 10_000])),
                      maybe("--streams", usual(["1", "2"], [*bad_ints, "65"])),
                      maybe("--only", usual(["eager baseline", "ERASE blocking"], ["nope", "", ",", "x" * 10_000]),
                            odds=4),
                      maybe("--trace", usual([FRESH_DIR], ["/proc/nope", str(w.plan), "a\x00b", "x" * 10_000]),
                            odds=2),
                      flag("--json"))
    start = st.tuples(st.just(["start"]), space_file.map(lambda p: ["--space", p]),
                      storage.map(lambda s: ["--storage", s]), refused_ray.map(lambda r: ["--ray-address", r]),
                      maybe("--study", study), maybe("--trials", usual(["1", "3"], bad_ints), 2),
                      maybe("--slots", usual(["1", "2"], bad_ints), 2), maybe("--gpu-wait", usual(["0.5"], bad_floats), 2),
                      maybe("--grace-period", usual(["10", "60"], [*bad_ints, "9"]), 2),
                      maybe("--repeats", usual(["0", "5"], bad_ints), 2), flag("--no-confirm"),
                      maybe("--working-dir", usual([str(w.root)], ["/nonexistent", "", "a\x00b"]), 2),
                      maybe("--py-module", usual([str(w.root)], ["/nonexistent", "", "a\x00b"]), 2), flag("--json"))
    status = st.tuples(st.just(["status"]), maybe("--study", study), maybe("--storage", storage, 6),
                       maybe("--trial", usual(["0", "5", "17"], [*bad_ints, "18", "99"]), 2), flag("--json"))
    outputs = usual([FRESH_FILE, str(w.existing)],
                    [str(w.root), str(w.readonly / "best.yaml"), str(w.root / "no" / "dir" / "best.yaml"), "", "a\x00b",
                     "/proc/best.yaml", str(w.plan) + "/x.yaml", "x" * 300])
    export = st.tuples(st.just(["export"]), maybe("--study", study, 8), maybe("--storage", storage, 8),
                       maybe("-o", outputs, 8), refused_ray.map(lambda r: ["--ray-address", r]),
                       maybe("--max-ne-gap", usual(["0.02", "1"], bad_floats), 2),
                       maybe("--pick", usual(["max-gain", "knee"], ["best", "", "x" * 10_000]), 2),
                       maybe("--repeats", usual(["5", "1"], ["6", "0", "-1", "1000000000000", "x"]), 2),
                       flag("--force"), flag("--json"),
                       maybe("--working-dir", usual([str(w.root)], ["/nonexistent", ""]), 2))
    report = st.tuples(st.just(["report"]), maybe("--study", study, 8), maybe("--storage", storage, 8),
                       maybe("-o", usual([FRESH_DIR], [str(w.plan), "", "a\x00b", "/proc/report",
                                                       str(w.readonly / "r"), "x" * 300]), 8))
    # Never a port the dashboard can bind: it would serve until interrupted.
    dashboard = st.tuples(st.just(["dashboard"]), maybe("--storage", storage, 6),
                          usual([str(w.busy_port)], ["0", "-1", "65536", "99999999999999999999", "x", ""]).map(
                              lambda p: ["--port", p]),
                          st.sampled_from([[], ["--host", "127.0.0.1"]]))
    db = st.tuples(st.just(["db"]), usual(["upgrade", "current"], ["bogus", "", "x" * 10_000]).map(lambda a: [a]),
                   maybe("--storage", storage, 6))
    commands = st.sampled_from([trial] * 4 + [bench] * 2 + [start] * 4 + [status] * 2 + [export] * 4 + [report] +
                               [dashboard] + [db] * 2).flatmap(lambda c: c)

    @st.composite
    def argv(draw: Any) -> list[str]:
        if draw(one_in(30)):
            return draw(st.sampled_from([[], ["frobnicate"], ["--version"], ["--help"], ["start", "--help"], ["-q", "-v"],
                                         ["--storage", "x"], ["export", "--study"], ["\x00"], ["-" * 10_000]]))
        parts = [p for part in draw(commands) for p in part]
        prefix = draw(usual(st.just([]), [["-v"], ["-vv"], ["-q"], ["-q", "-v"]], odds=4))
        suffix = draw(usual(st.just([]), [["--bogus"], ["extra"], ["--storage"], ["--json", "--json"]], odds=12))
        return prefix + parts + suffix

    return argv()


def run_command(w: CliWorld, argv: list[str]) -> tuple[int, str, str, dict[str, Path]]:
    """``erase-tune argv`` in-process: (exit code, stdout, stderr, the fresh paths it was given)."""
    fresh: dict[str, Path] = {}
    resolved = []
    for a in argv:
        if a in (FRESH_DB, FRESH_FILE, FRESH_DIR):
            fresh[a] = path = w.fresh(a)
            a = f"sqlite:///{path}" if a == FRESH_DB else str(path)
        resolved.append(a)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(resolved)
        except SystemExit as e:  # argparse: usage errors (2), --help and --version (0)
            code = e.code if isinstance(e.code, int) else 2
        except Exception as e:
            raise AssertionError(f"erase-tune {_argv_label(argv)} raised {type(e).__name__}: {e}"[:2000]) from e
    return code, out.getvalue(), err.getvalue(), fresh


def _argv_label(argv: list[str]) -> str:
    return " ".join(repr(a[:60]) + ("…" if len(a) > 60 else "") for a in argv)


BLANK_MEANS_DEFAULT = ("--storage", "--study", "--ray-address", "--working-dir", "--py-module")
"""Options whose empty value once silently meant "not given" (./erase-tune.db, the space's
file name, a private local Ray, the space's directory): an empty one must be refused."""


def check_command(w: CliWorld, argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` and check the CLI's contract; returns (exit code, the error line or "")."""
    code, out, err, fresh = run_command(w, argv)
    where = f"erase-tune {_argv_label(argv)}"
    command = next((a for a in argv if a in COMMAND_NAMES), None)
    assert code in EXIT_CODES, f"{where}: exit code {code}"
    assert "Traceback" not in err, f"{where}: a traceback on stderr:\n{err[-3000:]}"
    errors = [line for line in err.splitlines() if "error:" in line]
    blank = [a for a, v in itertools.pairwise(argv) if a in BLANK_MEANS_DEFAULT and not v.strip()]
    if blank and "--help" not in argv and "--version" not in argv:
        assert code == 2, f"{where}: an empty {blank[0]} was not refused (exit {code})"
    if code == 0:
        assert not errors, f"{where}: exit 0 with an error line: {errors}"
    elif code in (1, 2, 3):
        assert len(errors) == 1, f"{where}: exit {code} with {len(errors)} error lines: {err[-2000:]!r}"
        assert errors[0].startswith("erase-tune: error: "), f"{where}: {errors[0][:300]!r}"
        assert err.rstrip("\n").splitlines()[-1] == errors[0], f"{where}: the error is not the last line: {err[-2000:]!r}"
        one_line(errors[0], where)
        assert "s3cret" not in err + out, f"{where}: a password on the terminal"
    if code != 0:  # a refused command writes nothing
        db = fresh.get(FRESH_DB)
        assert db is None or not db.exists(), f"{where}: exit {code}, yet it created {db}"
        for key in (FRESH_FILE, FRESH_DIR):
            path = fresh.get(key)
            if path is not None and command in ("export", "report"):
                assert not path.exists(), f"{where}: exit {code}, yet it wrote {path}"
    if command == "export":
        leftovers = [p.name for p in w.root.glob(".*.yaml.*")]
        assert not leftovers, f"{where}: temporary files left behind: {leftovers}"
        if code == 0:
            target = next(argv[i + 1] for i, a in enumerate(argv) if a in ("-o", "--output"))
            target = str(fresh.get(FRESH_FILE, target))
            ErasePlan.load(target)  # what export writes is a plan production can load
    if code == 0 and "--json" in argv and command in ("trial", "bench", "status", "export"):
        json.loads(out)
    if code == 0 and command == "report":
        assert (fresh.get(FRESH_DIR) or Path(argv[argv.index("-o") + 1])).joinpath("report.html").is_file()
    return code, errors[0] if errors else ""


@pytest.fixture
def cli_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliWorld]:
    """The world, and a process state every case leaves as it found it: no storage, Ray
    address or journal of the developer's, cwd a scratch directory (the default storage is
    ./erase-tune.db), erase-tune's logger, Optuna's verbosity, warnings filters and sys.path
    restored after."""
    for name in ("ERASE_TUNE_STORAGE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ERASE_TUNE_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.setenv("ERASE_TUNE_STORAGE_RETRY_S", "1")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    logger = logging.getLogger("erase_tune")
    saved = (list(logger.handlers), logger.level, logger.propagate, optuna.logging.get_verbosity(), list(sys.path))
    world = CliWorld(tmp_path)
    try:
        with warnings.catch_warnings():
            yield world
    finally:
        world.busy.close()
        world.readonly.chmod(0o755)
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
        optuna.logging.set_verbosity(saved[3])
        sys.path[:] = saved[4]


def test_hostile_command_lines(bounds: Bounds, cli_world: CliWorld) -> None:
    w = cli_world
    before = w.snapshot()
    storage = f"sqlite:///{w.root / 'finished.db'}"
    closed = f"127.0.0.1:{w.closed_port}"
    tiny = [a for k, v in TINY_CTR.items() for a in ("--arg", f"{k}={v}")]
    budget = ["--warmup", "5", "--windows", "1", "--window-steps", "1"]
    export = ["export", "--study", w.study, "--storage", storage, "--ray-address", closed, "-o"]
    start = ["start", "--space", str(w.space), "--storage", FRESH_DB, "--ray-address"]
    trial = ["trial", "--workload", "ctr", *tiny, "--plan", str(w.plan), "--device", "cpu", *budget]
    bench = ["bench", "--workload", "ctr", *tiny, "--device", "cpu", "--only", "eager baseline", *budget]
    # The command lines, each with the exit code and the words its one line must hold.
    shapes: list[tuple[list[str], int, str]] = [
        ([*export, str(w.root)], 2, "is a directory"),
        ([*export, str(w.readonly / "best.yaml")], 0 if os.geteuid() == 0 else 2, ""),  # root writes anywhere
        ([*export, "a\x00b"], 2, "NUL"),
        ([*export, "x" * 300], 2, "File name too long"),
        ([*export, FRESH_FILE], 0, ""),
        ([*export, FRESH_FILE, "--repeats", "6"], 2, "nothing answers"),  # re-confirming needs Ray: refused
        (["export", "--study", "no-gain", "--storage", storage, "--ray-address", closed, "-o", FRESH_FILE], 1,
         "no plan on the front shows a gain"),
        (["start", "--space", str(w.space), "--storage", "", "--ray-address", closed], 2, "storage URL is empty"),
        (["start", "--space", str(w.space), "--study", "", "--storage", FRESH_DB, "--ray-address", closed], 2,
         "--study"),
        ([*start, closed], 2, "nothing answers"),
        ([*start, ""], 2, "--ray-address: must not be empty"),
        ([*start, "garbage"], 2, "not auto, host:port or ray://host:port"),
        ([*start, "127.0.0.1:" + "9" * 5000], 2, "(port 1..65535)"),
        ([*start, f"ray://{closed}"], 2, "nothing answers at ray://"),
        ([*start, closed, "--working-dir", ""], 2, "--working-dir: must not be empty"),
        (["start", "--space", str(w.space) + "\x00", "--storage", FRESH_DB, "--ray-address", closed], 2, "NUL"),
        ([*trial, "--arg", "rows=1000000000000"], 2, "rows=1000000000000"),
        ([*trial, "--arg", "lr=" + "9" * 400], 2, "too large"),
        ([*trial, "--device", "x" * 10_000], 2, "is not a device"),
        ([*trial, "--json"], 0, ""),
        (["trial", "--workload", "ctr", *tiny, "--plan", str(w.fifo), *budget], 2, "a plan must be a mapping"),
        (["start", "--space", str(w.fifo), "--storage", FRESH_DB, "--ray-address", closed], 2, "must be a search space"),
        ([*bench, "--streams", "1000000000000"], 2, "num_streams"),
        ([*bench, "--trace", "/proc/nope"], 2, "--trace"),
        (["status", "--storage", ""], 2, "storage URL is empty"),
        (["status", "--storage", storage, "--study", "\x1b[2J"], 2, "no study named '\\x1b[2J'"),
        (["status", "--storage", "sqlite:///" + "a/" * 3000 + "x.db"], 2, "no database file"),
        (["start", "--space", str(w.space), "--trials", "9" * 5000], 2, "invalid int value"),
        (["report", "--study", w.study, "--storage", storage, "-o", FRESH_DIR], 0, ""),
        (["report", "--study", "nope", "--storage", storage, "-o", FRESH_DIR], 2, "no study named 'nope'"),
        (["dashboard", "--storage", storage, "--port", str(w.busy_port)], 2, "cannot listen"),
        (["db", "upgrade", "--storage", FRESH_DB], 0, ""),
    ]
    expected = {tuple(argv): (code, needle) for argv, code, needle in shapes}

    def case(argv: list[str]) -> None:
        with bounds.case("command lines", _argv_label(argv)):
            code, line = check_command(w, argv)
        bounds.outcomes[f"command lines:exit {code}"] += 1
        if tuple(argv) in expected:
            want, needle = expected[tuple(argv)]
            assert (code, needle in line) == (want, True), f"erase-tune {_argv_label(argv)}: exit {code}: {line!r}"

    for argv, _, _ in shapes:
        case = example(argv=argv)(case)
    given(argv=command_lines(w))(profile(CLI_CASES)(case))()
    assert w.snapshot() == before, "a command changed or lost what the finished job had stored"
    bounds.report("command lines", CLI_CASES)


def test_generated_yaml_reads_back() -> None:
    """The generator's own YAML writer: what it writes is what PyYAML reads back."""
    import yaml

    tree = {"a": [1, 2.5, 1e-05, None, True, "yes", "a\nb\x00\u2028\ud800🙂\\\""], "b": {"c": math.inf}, 3: "x"}
    assert yaml.safe_load(emit(tree)) == tree
