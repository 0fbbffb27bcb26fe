"""Named suites: the GPU campaign's phases (once scripts/gpu_campaign.sh PHASE) and the GPU
validation (once scripts/gpu_validate.sh WHAT), as lists of steps run by the benchmark runner.

    python -m erase_tune.benchmarks --suite s1 --out "$OUT"          # was: OUT=$OUT bash scripts/gpu_campaign.sh s1
    python -m erase_tune.benchmarks --suite s1 --out "$OUT" --dry-run  # the steps and their limits

A step is one subprocess (a benchmark case, a test run, an ``erase-tune`` command) under its own
time limit (SIGTERM to its process group, SIGKILL 10 s later; ``rc=124`` as ``timeout`` says), so
a suite ends inside the device's 10 minutes whatever happens. Each step logs to
``$OUT/work/NAME.log``; ``$OUT/work/summary.txt`` gets one line per step (``NAME rc=RC SECONDSs``);
the GPU, torch and date go to ``$OUT/work/gpu.txt``; everything in ``$OUT/work`` is packed into
``$OUT/SUITE.tar.gz`` (the device hands back few files); the summary and each log's last lines
are printed last. A suite is groups run in order; a group's lanes run side by side (one per GPU),
the steps of a lane one after another.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from erase_tune.benchmarks.case import ROOT

__all__ = ["SUITES", "Step", "Suite", "run_suite"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    gpus: str
    """CUDA_VISIBLE_DEVICES for the step ("0", "1", "0,1")."""
    argv: tuple[str, ...]
    """The command; ``{py}`` (this Python), ``{work}`` and the suite's variables are filled in."""
    stdout: str | None = None
    """A file under work/ for the step's stdout (its stderr still goes to the log)."""
    fatal: bool = False
    """A set-up step: the suite stops when it fails."""


Lane = tuple[Step, ...]


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    description: str
    figures: tuple[str, ...]
    groups: tuple[tuple[Lane, ...], ...]
    gpus: int = 1
    variables: dict[str, str] = dataclasses.field(default_factory=dict)
    copy_in: tuple[tuple[str, str], ...] = ()
    """(source in the checkout, name under work/) copied before the first step."""
    report: Callable[[Path], None] | None = None
    """Printed after the summary (from what the steps wrote under work/)."""

    def steps(self) -> list[Step]:
        return [s for group in self.groups for lane in group for s in lane]


def seq(*steps: Step) -> tuple[tuple[Lane, ...], ...]:
    """One group of one lane: the steps one after another."""
    return ((tuple(steps),),)


def bench(case: str, *args: str) -> tuple[str, ...]:
    return ("{py}", "-m", "erase_tune.benchmarks", case, "--out", "{work}", *args)


def et(*args: str) -> tuple[str, ...]:
    return ("{py}", "-m", "erase_tune", *args)


def pytest(*args: str) -> tuple[str, ...]:
    return ("{py}", "-m", "pytest", *args)


GPU_TESTS = pytest("--noconftest", "-q", "-m", "gpu", "tests/runtime", "tests/measure", "-p", "no:cacheprovider")
CTR = ("--arg", "batch=2048", "--arg", "width=256", "--arg", "emb_dim=64", "--arg", "rows=100000", "--arg", "sub_out=64",
       "--arg", "train_batches=16", "--arg", "eval_batches=2", "--device", "cuda", "--windows", "6",
       "--window-steps", "20", "--json")
DLRM = ("--workload", "dlrm", "--arg", "batch=4096", "--arg", "train_batches=64", "--arg", "eval_batches=2",
        "--device", "cuda")
REPLAY = ("--space", "search_spaces/ctr-replay.yaml")
RANK = ("--space", "search_spaces/ctr.yaml", "--plans", "12", "--scale", "4", "--arg", "train_batches=1700")


def _bench_ctr(name: str, limit: int, batch: int) -> Step:
    return Step(name, limit, "0", et("bench", "--workload", "ctr", "--arg", f"batch={batch}", *CTR[2:]))


def _gpu_tests(limit: int, *paths: str) -> Step:
    """The ``gputests`` step: the GPU-marked tests under ``paths``, quiet, without pytest's cache."""
    return Step("gputests", limit, "0", pytest("-q", "-m", "gpu", *paths, "-p", "no:cacheprovider"))


def _study(name: str, limit: int, gpus: str, space: str, study: str, db: str, *more: str) -> Step:
    return Step(name, limit, gpus, et("start", "--space", space, "--study", study, "--storage",
                                      f"sqlite:///{{work}}/{db}", *more))


def _status(name: str, limit: int, gpus: str, study: str, db: str) -> Step:
    return Step(name, limit, gpus, et("status", "--study", study, "--storage", f"sqlite:///{{work}}/{db}"))


def _campaign(phase: str, batch: int, trials: int, limit: int) -> Suite:
    """d, e, g: ctr.yaml with the whole-step graph fixed on, the NE budget at 1%, at one batch."""
    study = f"ctr-{batch}" + ("-g" if phase == "g" else "")
    db = f"tune_{batch}.db"
    steps = [Step("campaign_space", 60, "0", bench("campaign_space", "--src", "search_spaces/ctr.yaml", "--dst",
                                                   f"{{work}}/ctr-{batch}.yaml", "--batch", str(batch),
                                                   "--max-ne-gap", "0.01", "--trials", str(trials)), fatal=True)]
    if phase == "e":
        steps.append(Step("gputests", 60, "0", GPU_TESTS))
    steps += [_study(f"tune_ctr{batch}", limit, "0", f"{{work}}/ctr-{batch}.yaml", study, db),
              _status(f"status_ctr{batch}", 20, "0", study, db),
              Step(f"export_ctr{batch}", 60, "0", et("export", "--study", study, "--storage", f"sqlite:///{{work}}/{db}",
                                                     "--max-ne-gap", "0.01", "-o", f"{{work}}/best_{batch}.yaml",
                                                     "--json"))]
    what = {"d": "at a ranking-sized batch (8192), 16 trials + confirmation, export within a 1% NE budget",
            "e": "the GPU tests, then the same at batch 2048 with 24 trials",
            "g": "the same at batch 2048 with 20 trials (study ctr-2048-g): the default sampler on real measurements"}
    figures = {"d": ("0.1 The shipped product against the issue's table (batch 8192)",),
               "e": ("0.1 The shipped product against the issue's table (batch 2048)",
                     "0.2 A real erase-tune start with its confirmation", "0.8 GPU tests"),
               "g": ("0.3.1 The default sampler on the H200: a real 20-trial study",)}
    return Suite(phase, f"campaign space (ctr.yaml, whole-step graph, 1% budget) {what[phase]}", figures[phase],
                 seq(*steps))


def _validate_report(work: Path) -> None:
    """gpu_validate's last table: each trace bench's rows; the traces gzipped."""
    for d in sorted(work.glob("trace_*")):
        if d.is_dir():
            for f in d.glob("*.json"):
                with open(f, "rb") as src, gzip.open(f.with_name(f.name + ".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                f.unlink()
    for f in sorted(work.glob("trace_bench_*.json")):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            print(f"{f.name}: no JSON (see its log)")
            continue
        for r in d["rows"]:
            g = r["vs_graph"] or [0, 0, 0]
            ov = r["overlap"]
            print(f"b={d['batch_size']:<6} {r['name']:<22} vs eager {r['vs_eager'][0]:.2f}x  vs graph {g[0]:.2f}x  "
                  f"overlap {'-' if ov is None else format(ov, '.0%')}")


def _trace(batch: int) -> Step:
    return Step(f"trace_{batch}", 150, "0",
                et("bench", "--workload", "ctr", "--arg", f"batch={batch}", *CTR[2:14], "--device", "cuda",
                   "--windows", "4", "--window-steps", "20", "--only", "ERASE threaded,graph + detach only,graph + ERASE",
                   "--trace", f"{{work}}/trace_{batch}", "--json"),
                stdout=f"trace_bench_{batch}.json")


_VALIDATE_TESTS = (Step("gpu_tests", 420, "0", pytest("-q", "-m", "gpu", "-p", "no:cacheprovider", "tests")),)
_VALIDATE_TRACE = (_trace(2048), _trace(32768))
_VALIDATE_TUNE = (Step("tune", 480, "0", et("start", "--space", "{space}", "--study", "gpu", "--trials", "{trials}",
                                            "--storage", "sqlite:///{work}/tune.db")),
                  _status("status", 30, "0", "gpu", "tune.db"),
                  Step("export", 60, "0", et("export", "--study", "gpu", "--storage", "sqlite:///{work}/tune.db",
                                             "-o", "{work}/best.yaml")))
_VALIDATE_VARS = {"trials": "24", "space": "search_spaces/ctr.yaml"}

_host_profile = ("host_profile", *DLRM, "--steps", "60")

SUITE_LIST: list[Suite] = [
    Suite("a", "two GPUs: GPU0 replay shard 0, bench 2048/8192, deep-MLP times, GPU tests; GPU1 rank agreement, "
               "replay shard 1",
          ("0.3 Tuner efficiency, by replay (the table)", "0.5 Kendall's tau", "0.7 The paper's deep-MLP check"),
          ((((Step("gputests", 90, "0", GPU_TESTS), _bench_ctr("bench2048", 75, 2048), _bench_ctr("bench8192", 75, 8192),
              Step("mlp_backward", 45, "0", bench("mlp_backward")),
              Step("replay0", 250, "0", bench("replay_table", *REPLAY, "--shard", "0/2", "--tag", "shard0"))),
             (Step("rank", 260, "1", bench("rank_agreement", *RANK)),
              Step("replay1", 260, "1", bench("replay_table", *REPLAY, "--shard", "1/2", "--tag", "shard1")))),)),
          gpus=2),
    Suite("a1", "the GPU tests, bench at batch 2048 and 8192, the deep-MLP backward/step times, the replay table",
          ("0.1 The shipped product against the issue's table (bench rows)", "0.3 Tuner efficiency, by replay (the table)",
           "0.7 The paper's deep-MLP check, on the H200", "0.8 GPU tests"),
          seq(Step("gputests", 90, "0", GPU_TESTS), _bench_ctr("bench2048", 75, 2048), _bench_ctr("bench8192", 75, 8192),
              Step("mlp_backward", 45, "0", bench("mlp_backward")),
              Step("replay", 230, "0", bench("replay_table", *REPLAY, "--shard", "0/1")))),
    Suite("a2", "the short-vs-4x-budget rank agreement, and erase-tune start on search_spaces/ctr.yaml",
          ("0.5 Does the short budget rank plans as a 4x longer one?", "0.2 A real erase-tune start with its confirmation"),
          seq(Step("rank", 240, "0", bench("rank_agreement", *RANK)),
              _study("tune_ctr", 300, "0", "search_spaces/ctr.yaml", "ctr-h200", "tune.db"),
              _status("status_ctr", 30, "0", "ctr-h200", "tune.db"))),
    Suite("a3", "finish a2's study (its database carried back in gpu_in/), then short gpt and mlp jobs",
          ("0.2 A real erase-tune start with its confirmation", "0.6 gpt and mlp spaces (8 trials each, one H200)"),
          seq(_study("tune_ctr", 170, "0", "search_spaces/ctr.yaml", "ctr-h200", "tune.db"),
              _status("status_ctr", 20, "0", "ctr-h200", "tune.db"),
              _study("tune_gpt", 150, "0", "search_spaces/gpt.yaml", "gpt-h200", "tune_gpt.db", "--trials", "8",
                     "--repeats", "3"),
              _study("tune_mlp", 150, "0", "search_spaces/mlp.yaml", "mlp-h200", "tune_mlp.db", "--trials", "8",
                     "--repeats", "3")),
          copy_in=(("gpu_in/tune.db", "tune.db"),)),
    Suite("b1", "erase-tune start on the gpt and mlp spaces (12 trials each)",
          ("0.6 gpt and mlp spaces",),
          seq(_study("tune_gpt", 260, "0", "search_spaces/gpt.yaml", "gpt-h200", "tune_gpt.db", "--trials", "12"),
              _study("tune_mlp", 260, "0", "search_spaces/mlp.yaml", "mlp-h200", "tune_mlp.db", "--trials", "12"))),
    Suite("b", "two GPUs: erase-tune start on ctr.yaml over both (24 trials, the front confirmed), then gpt and mlp "
               "(12 trials each, one GPU each)",
          ("3. A real tuning job: erase-tune start on the CTR space through Ray",),
          (((_study("tune_ctr", 330, "0,1", "search_spaces/ctr.yaml", "ctr-h200", "tune.db"),
             _status("status_ctr", 30, "0,1", "ctr-h200", "tune.db")),),
           ((_study("tune_gpt", 200, "0", "search_spaces/gpt.yaml", "gpt-h200", "tune_gpt.db", "--trials", "12"),),
            (_study("tune_mlp", 200, "1", "search_spaces/mlp.yaml", "mlp-h200", "tune_mlp.db", "--trials", "12"),))),
          gpus=2),
    _campaign("d", 8192, 16, 480),
    _campaign("e", 2048, 24, 400),
    _campaign("g", 2048, 20, 400),
    Suite("f", "the campaign space at batch 32768 (smaller data pools), 8 trials, seeded with the plans d and e exported",
          ("0.1 The shipped product against the issue's table (batch 32768)",),
          seq(Step("campaign_space", 60, "0", bench(
              "campaign_space", "--src", "search_spaces/ctr.yaml", "--dst", "{work}/ctr-32768.yaml", "--batch", "32768",
              "--max-ne-gap", "0.01", "--trials", "8", "--arg", "train_batches=320", "--arg", "eval_batches=4",
              "--seed-plan", "docs/results/h200-2026-12-01/best_ctr2048_graph.yaml",
              "--seed-plan", "docs/results/h200-2026-12-01/best_ctr8192_graph.yaml"), fatal=True),
              _study("tune_ctr32768", 430, "0", "{work}/ctr-32768.yaml", "ctr-32768", "tune_32768.db"),
              _status("status_ctr32768", 15, "0", "ctr-32768", "tune_32768.db"),
              Step("export_ctr32768", 90, "0", et("export", "--study", "ctr-32768", "--storage",
                                                  "sqlite:///{work}/tune_32768.db", "-o", "{work}/best_32768.yaml",
                                                  "--json")))),
    Suite("h", "the host cost on dlrm at batch 4096 (issue 16): host-CPU and reference GPU tests, the host table, bench",
          ("00.1 Where a host-bound step's time goes, re-measured on the product", "00.2 A real study on dlrm (bench)"),
          seq(_gpu_tests(150, "tests/measure/test_hostcpu.py", "tests/test_reference_gpu.py",
                         "tests/tune/test_reference_gpu.py"),
              Step("host_table", 330, "0", bench("host_table", *DLRM, "--windows", "10", "--window-steps", "30",
                                                 "--cpu-windows", "16")),
              Step("bench_dlrm", 120, "0", et("bench", *DLRM, "--windows", "6", "--window-steps", "30",
                                              "--only", "ERASE blocking")))),
    Suite("h2", "the host-CPU pass alternating step by step, bench on dlrm, the NE rank agreement",
          ("00.4 The host tax as CPU time, and the NE rank agreement",),
          seq(Step("host_table", 200, "0", bench("host_table", *DLRM, "--windows", "6", "--window-steps", "30",
                                                 "--cpu-windows", "500", "--cpu-window-steps", "1")),
              Step("bench_dlrm", 100, "0", et("bench", *DLRM, "--windows", "6", "--window-steps", "30")),
              Step("ne_rank", 290, "0", bench("ne_evidence", "--spaces", "ctr", "--rank-arg", "train_batches=1700",
                                              "--time-limit", "120", "--overrun", "150")))),
    Suite("h3", "after the engine split: GPU tests, where a placement's host time goes, mlp's noise floor, a dlrm "
                "study confirmed for quality",
          ("00.5 After the engine split",),
          seq(_gpu_tests(200, "tests/runtime", "tests/measure", "tests/workloads/test_dlrm.py",
                         "tests/test_reference_gpu.py", "tests/tune/test_reference_gpu.py", "tests/test_noise.py"),
              Step("host_profile", 45, "0", bench("host_profile", *DLRM, "--steps", "100")),
              Step("ne_mlp", 60, "0", bench("ne_evidence", "--spaces", "mlp", "--skip-rank", "--time-limit", "50")),
              _study("tune_dlrm", 230, "0", "search_spaces/dlrm.yaml", "dlrm-q", "dlrm_q.db", "--trials", "6",
                     "--quality-scale", "2", "--quality-seeds", "2"),
              _status("status_dlrm", 15, "0", "dlrm-q", "dlrm_q.db"))),
    Suite("h4", "the stream fast path: runtime GPU tests, the attribution, the host table again",
          ("00.6 The stream fast path",),
          seq(_gpu_tests(110, "tests/runtime", "tests/measure/test_hostcpu.py"),
              Step("host_profile", 60, "0", bench(*_host_profile, "--rounds", "400")),
              Step("host_table", 120, "0", bench("host_table", *DLRM, "--windows", "4", "--window-steps", "30",
                                                 "--cpu-windows", "400", "--cpu-window-steps", "1")))),
    Suite("h5", "GPU tests, the per-cut-graph drift check, attribution of a placement and of a blocking cut (A/A pairs), "
                "the host table with its by-hand rows",
          ("00.7 A lean join, measured and not shipped", "00.8 The lean join verified and shipped"),
          seq(_gpu_tests(170, "tests/runtime", "tests/measure", "tests/workloads/test_dlrm.py",
                         "tests/test_reference_gpu.py", "tests/tune/test_reference_gpu.py"),
              Step("drift", 120, "0", bench("graph_drift")),
              Step("host_profile", 80, "0", bench(*_host_profile, "--rounds", "1000")),
              Step("host_profile_cut", 80, "0", bench(*_host_profile, "--rounds", "1000", "--cut", "bot_l",
                                                      "--tag", "cut")),
              Step("host_table", 200, "0", bench("host_table", *DLRM, "--windows", "4", "--window-steps", "30",
                                                 "--cpu-windows", "600", "--cpu-window-steps", "1")))),
    Suite("s1", "issue 27 on the reference DLRM: the protocol's GPU tests, a study with no seeds within "
                "--time-budget 6m, its status and export",
          ("000.1 The reference DLRM, no seeds", "000.3 What issue 27's targets read"),
          seq(_gpu_tests(70, "tests/measure", "tests/test_reference_gpu.py"),
              _study("dlrm_study", 400, "0", "search_spaces/dlrm.yaml", "dlrm", "dlrm.db", "--time-budget", "6m"),
              _status("dlrm_status", 20, "0", "dlrm", "dlrm.db"),
              Step("dlrm_export", 40, "0", et("export", "--study", "dlrm", "--storage", "sqlite:///{work}/dlrm.db",
                                              "-o", "{work}/best_dlrm.yaml")))),
    Suite("s2", "issue 27 on a DeepFM: a study with no seeds within 4 minutes, and export",
          ("000.2 A DeepFM, no seeds", "000.3 What issue 27's targets read"),
          seq(_study("deepfm_study", 300, "0", "search_spaces/deepfm.yaml", "deepfm", "deepfm.db", "--time-budget", "4m"),
              Step("deepfm_export", 40, "0", et("export", "--study", "deepfm", "--storage",
                                                "sqlite:///{work}/deepfm.db", "-o", "{work}/best_deepfm.yaml")))),
    Suite("s3", "CPU-only work owed on the GPU: dropout masks under graphs and side streams, bench skipping a row "
                "that cannot be captured, check --space on CUDA",
          ("(owed checks, no figure yet: GPU tests of 2026-12-04)",),
          seq(_gpu_tests(200, "tests/measure", "tests/runtime", "tests/test_reference_gpu.py", "tests/test_bench_rows.py",
                         "tests/tune/test_check_space.py"),
              Step("dlrm_check", 120, "0", et("check", "--space", "search_spaces/dlrm.yaml")),
              Step("deepfm_dropout_bench", 200, "0", et("bench", "--workload", "deepfm", "--arg", "dropout=0.2",
                                                        "--device", "cuda")))),
    Suite("s4", "issue 27's owed GPU runs (1 of 2): the CTR proxy's bench at batch 2048 (the whole-step graph "
                "against eager), and a 12-trial gpt study with no time budget (the whole job against its trials' time)",
          ("0000.5 Issue 27's targets after this campaign",),
          seq(_bench_ctr("bench2048", 150, 2048),
              _study("gpt_study", 330, "0", "search_spaces/gpt.yaml", "gpt", "gpt.db", "--trials", "12"))),
    Suite("s5", "issue 27's owed GPU runs (2 of 2): a dlrm study with no seeds, then every trial of it re-measured "
                "(Kendall's tau of searched against re-measured gains)",
          ("0000.5 Issue 27's targets after this campaign",),
          seq(_study("dlrm_study", 380, "0", "search_spaces/dlrm.yaml", "dlrm", "dlrm.db", "--time-budget", "6m"),
              Step("dlrm_recheck", 200, "0", bench("study_recheck", "--storage", "sqlite:///{work}/dlrm.db",
                                                   "--study", "dlrm")))),
    Suite("s6", "issue 27's gpt study end to end with the quality confirmation reusing the noise floor's baseline "
                "(the whole job against its trials' time), then the process-group SIGTERM check (issue 30) on a "
                "second gpt job stopped by the step's limit mid-trial, and its status",
          ("00000.4 gpt, the whole job", "00000.5 SIGTERM to the job's process group on the GPU"),
          seq(_study("gpt_study", 400, "0", "search_spaces/gpt.yaml", "gpt", "gpt.db", "--trials", "12"),
              _status("gpt_status", 40, "0", "gpt", "gpt.db"),
              _study("gpt_sigterm", 50, "0", "search_spaces/gpt.yaml", "gpt-term", "term.db", "--trials", "12"),
              _status("term_status", 40, "0", "gpt-term", "term.db"))),
    Suite("n", "the NE gap's evidence: the noise floor of every shipped space and the rank agreement over 12 plans",
          ("00.2b The noise floor of the NE gap", "00.4 NE rank agreement (issue 17)"),
          seq(Step("ne_evidence", 480, "0", bench("ne_evidence", "--rank-arg", "train_batches=1700")))),
    Suite("c", "two GPUs: the data-parallel Table 1 and erase-tune start on ctr-ddp.yaml",
          ("0.9 Owed from this campaign (the two-GPU runs)",),
          seq(Step("ddp_table1", 240, "0,1", bench("ddp_table1")),
              _study("tune_ddp", 240, "0,1", "search_spaces/ctr-ddp.yaml", "ctr-ddp", "tune_ddp.db")),
          gpus=2),
    Suite("validate", "the GPU evidence of 2026-11-30 (once scripts/gpu_validate.sh all): GPU tests, traced bench, "
                      "a tuning job (--var trials=N --var space=FILE)",
          ("1. Runtime variants on the CTR proxy", "2. Cross-stream overlap from profiler traces",
           "3. A real tuning job", "GPU tests (2026-11-30)"),
          seq(*_VALIDATE_TESTS, *_VALIDATE_TRACE, *_VALIDATE_TUNE), variables=_VALIDATE_VARS, report=_validate_report),
    Suite("validate-tests", "the whole GPU test suite (once scripts/gpu_validate.sh tests)",
          ("GPU tests (2026-11-30)",), seq(*_VALIDATE_TESTS)),
    Suite("validate-trace", "bench at batch 2048 and 32768 with profiler traces (once scripts/gpu_validate.sh trace)",
          ("2. Cross-stream overlap from profiler traces",), seq(*_VALIDATE_TRACE), report=_validate_report),
    Suite("validate-tune", "a tuning job through Ray, its status and export (once scripts/gpu_validate.sh tune)",
          ("3. A real tuning job: erase-tune start on the CTR space through Ray",), seq(*_VALIDATE_TUNE),
          variables=_VALIDATE_VARS),
]
SUITES: dict[str, Suite] = {s.name: s for s in SUITE_LIST}


def _fill(argv: tuple[str, ...], values: dict[str, str]) -> list[str]:
    return [a.format(**values) for a in argv]


def describe(suite: Suite, values: dict[str, str]) -> list[str]:
    lines = [f"suite {suite.name}: {suite.description}"]
    for gi, group in enumerate(suite.groups):
        for li, lane in enumerate(group):
            if len(suite.groups) > 1 or len(group) > 1:
                lines.append(f"  group {gi + 1}, lane {li + 1}{' (side by side)' if len(group) > 1 else ''}:")
            for s in lane:
                cmd = " ".join(_fill(s.argv, values))
                lines.append(f"  {s.name:<22} limit {s.limit_s:>4}s  GPUs {s.gpus:<4} {cmd}"
                             + (f" > {s.stdout}" if s.stdout else "") + ("  (set-up: stops the suite)" if s.fatal else ""))
    total = sum(max(sum(s.limit_s for s in lane) for lane in group) for group in suite.groups)
    lines.append(f"  at most {total}s in all")
    return lines


TERM_GRACE_S = 30
"""How long a step stopped by its limit has, after SIGTERM to its process group, before SIGKILL
(a job fails its trials in storage, then gives Ray's clean-up 15 s)."""


def _run_step(step: Step, values: dict[str, str], work: Path, env: dict[str, str], summary, lock) -> int:
    log = work / f"{step.name}.log"
    t0 = time.monotonic()
    with open(log, "wb") as err:
        out = open(work / step.stdout, "wb") if step.stdout else err
        try:
            try:
                proc = subprocess.Popen(_fill(step.argv, values), cwd=ROOT, stdout=out, stderr=err,
                                        env={**env, "CUDA_VISIBLE_DEVICES": step.gpus}, start_new_session=True)
            except OSError as e:
                err.write(f"cannot start: {e}\n".encode())
                rc = 127
            else:
                try:
                    rc = proc.wait(timeout=step.limit_s)
                except subprocess.TimeoutExpired:  # as timeout(1): TERM, then KILL; 124
                    os.killpg(proc.pid, signal.SIGTERM)
                    termed = time.monotonic()
                    try:
                        ended = f"exit {proc.wait(timeout=TERM_GRACE_S)}"
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        ended = "killed"
                    err.write(f"\n[suite] limit {step.limit_s}s: SIGTERM to the process group; {ended} "
                              f"{time.monotonic() - termed:.1f}s later\n".encode())
                    rc = 124
        finally:
            if out is not err:
                out.close()
    with lock:
        summary.write(f"{step.name} rc={rc} {round(time.monotonic() - t0)}s\n")
        summary.flush()
    return rc


def run_suite(suite: Suite, out: Path, *, variables: dict[str, str] | None = None, dry_run: bool = False) -> int:
    work = out / "work"
    values = {"py": sys.executable, "work": str(work), **suite.variables, **(variables or {})}
    if dry_run:
        print("\n".join(describe(suite, values)))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", ERASE_TUNE_JOURNAL_DIR=str(work / "journal"))
    for src, dst in suite.copy_in:
        try:
            shutil.copy(ROOT / src, work / dst)
        except OSError as e:
            print(f"suite {suite.name}: {src}: {e.strerror or e}", file=sys.stderr)
            return 2
    lock = threading.Lock()
    stopped = False
    with open(work / "summary.txt", "a") as summary:
        for group in suite.groups:
            failed: list[Step] = []

            def lane_run(lane: Lane) -> None:
                for step in lane:
                    if _run_step(step, values, work, env, summary, lock) != 0 and step.fatal:
                        failed.append(step)
                        return

            threads = [threading.Thread(target=lane_run, args=(lane,)) for lane in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if failed:
                stopped = True
                print(f"suite {suite.name}: set-up step {failed[0].name} failed (see {work / failed[0].name}.log)",
                      file=sys.stderr)
                break
    _environment(work, env)
    with tarfile.open(out / f"{suite.name}.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="work")
    print((work / "summary.txt").read_text(), end="")
    for log in sorted(work.glob("*.log")):
        print(f"== {log.name}")
        lines = log.read_text(errors="replace").splitlines()[-6:]
        if lines:
            print("\n".join(lines))
    if suite.report is not None:
        suite.report(work)
    return 2 if stopped else 0


def _environment(work: Path, env: dict[str, str]) -> None:
    """work/gpu.txt: the GPUs and driver, torch and CUDA, the date (as the campaign script wrote it)."""
    lines = []
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                [sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"]):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
            lines.append((p.stdout + p.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"{cmd[0]}: {e}")
    lines.append(time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()))
    (work / "gpu.txt").write_text("\n".join(lines) + "\n")
