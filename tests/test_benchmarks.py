"""The benchmark runner (python -m erase_tune.benchmarks, issue 28): every case and suite listed
with the figure of docs/benchmarks.md it regenerates, every case's options parse, small cases run
on the CPU to one JSON result with provenance, a CUDA-only case refuses in one line, a suite's dry
run shows its steps and limits, and a suite's step is cut at its limit and packed as before."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from erase_tune.benchmarks import load_cases
from erase_tune.benchmarks.runner import _case_parser, main
from erase_tune.benchmarks.suites import SUITES, Step, Suite, run_suite, seq

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = re.findall(r"^#+ (\S+)", (ROOT / "docs/benchmarks.md").read_text(), flags=re.M)


def _cites_a_section(figure: str) -> bool:
    return any(figure.startswith(s + " ") or figure == s for s in SECTIONS) or figure.startswith("(owed")


def test_list_shows_every_case_and_suite_with_a_figure(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    cases = load_cases()
    assert set(cases) == {"campaign_space", "ddp_table1", "graph_drift", "host_profile", "host_table", "host_trace",
                          "mlp_backward", "ne_evidence", "rank_agreement", "replay_table", "sampler_efficiency",
                          "study_recheck"}
    for name, case in cases.items():
        block = out.split(f"\n  {name} ", 1)[1].split("\n  ", 1)[0]
        assert case.description in block
        assert case.figures and all(_cites_a_section(f) for f in case.figures), (name, case.figures)
        assert f"figure: docs/benchmarks.md {case.figures[0]}" in out
    assert cases["graph_drift"].needs() == "needs CUDA" and cases["ddp_table1"].gpus == 2
    for name in ("a", "a1", "a2", "a3", "b", "b1", "c", "d", "e", "f", "g", "h", "h2", "h3", "h4", "h5",
                 "s1", "s2", "s3", "s4", "s5", "n", "validate", "validate-tests", "validate-trace", "validate-tune"):
        assert name in SUITES, name
        assert f"\n  {name} " in out
        assert SUITES[name].figures and all(_cites_a_section(f) for f in SUITES[name].figures), name


@pytest.mark.parametrize("name", sorted(load_cases()))
def test_every_case_parses_its_options(name):
    case = load_cases()[name]
    defaults = case.parse(vars(_case_parser(case).parse_args([])))
    assert isinstance(defaults, case.options)
    argv = []
    if hasattr(defaults, "arg"):
        argv += ["--arg", "batch=8", "--arg", "width=4"]
    if hasattr(defaults, "device"):
        argv += ["--device", "cpu"]
    parsed = case.parse(vars(_case_parser(case).parse_args(argv)))
    if argv[:1] == ["--arg"]:
        assert parsed.arg == ["batch=8", "width=4"] and defaults.arg == []
    with pytest.raises(SystemExit):
        _case_parser(case).parse_args(["--no-such-option"])


def test_every_suite_step_of_the_runner_names_a_case_with_options_that_parse():
    cases = load_cases()
    for suite in SUITES.values():
        for step in suite.steps():
            if step.argv[1:3] != ("-m", "erase_tune.benchmarks"):
                continue
            name, rest = step.argv[3], list(step.argv[4:])
            assert rest[:2] == ["--out", "{work}"], step
            rest = rest[2:]
            if "--tag" in rest:
                i = rest.index("--tag")
                del rest[i:i + 2]
            cases[name].parse(vars(_case_parser(cases[name]).parse_args(rest)))


def _record(path: Path) -> dict:
    record = json.loads(path.read_text())
    assert record["complete"] and record["provenance"]["date_utc"] and record["provenance"]["torch"]
    assert record["provenance"]["case"] == record["case"]
    return record


def test_a_cpu_case_runs_to_one_json_with_provenance(tmp_path, capsys):
    """mlp_backward on the CPU (tiny widths): the steps run, the result and its provenance are written."""
    rc = main(["mlp_backward", "--out", str(tmp_path), "--device", "cpu", "--arg", "batch=8", "--arg", "width=8",
               "--warmup", "1", "--windows", "1", "--steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    record = _record(tmp_path / "mlp_backward.json")
    assert record["provenance"]["device"] == "cpu" and record["options"]["device"] == "cpu"
    assert set(record["result"]["rows"]) == {"no cuts", "detach only", "early, main stream", "early, side streams"}
    assert out.rstrip().endswith(record["result"]["table"].splitlines()[-1])  # the table is printed last
    assert "mlp_backward: wrote" in (tmp_path / "mlp_backward.log").read_text()


def test_a_cases_arg_values_are_read_as_the_clis_are(tmp_path, capsys):
    """--arg of a case goes through the CLI's bounded reader: one line for what it refuses, and
    ``1e-3`` a float (plain YAML 1.1 made it a string)."""
    deep = "x=" + "[" * 300 + "]" * 300
    assert main(["mlp_backward", "--out", str(tmp_path), "--device", "cpu", "--arg", deep]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mlp_backward: --arg x: nested more than 32 levels deep"
    assert main(["mlp_backward", "--out", str(tmp_path), "--device", "cpu", "--arg", "batch"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mlp_backward: --arg: 'batch' is not KEY=VALUE"
    from erase_tune.workloads import workload_args
    assert workload_args(["lr=1e-3", "mlp=512-256"]) == {"lr": 1e-3, "mlp": "512-256"}


def test_two_cases_in_one_run_each_take_their_options(tmp_path, capsys):
    dst = tmp_path / "space.yaml"
    rc = main(["campaign_space", "sampler_efficiency", "--out", str(tmp_path), "--tag", "t", "--dst", str(dst),
               "--batch", "1024", "--trials", "8", "--seeds", "1", "--samplers", "random"])
    assert rc == 0, capsys.readouterr()
    space = _record(tmp_path / "campaign_space-t.json")
    assert space["result"]["space"] == str(dst) and dst.exists() and space["options"]["trials"] == 8
    replay = _record(tmp_path / "sampler_efficiency-t.json")
    assert replay["result"]["replay"] and list(replay["result"]["runs"]) == ["random"]
    assert replay["options"]["trials"] == 8  # both cases know --trials: each took it
    with pytest.raises(SystemExit):
        main(["campaign_space", "mlp_backward", "--out", str(tmp_path), "--no-such-option"])


def test_a_cuda_only_case_on_the_cpu_exits_2_in_one_line(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "erase_tune.benchmarks", "graph_drift", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["graph_drift: needs CUDA, and there is no CUDA device here"]
    assert not (tmp_path / "graph_drift.json").exists()


def test_a_suites_dry_run_prints_its_steps_and_limits(capsys):
    assert main(["--suite", "s1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for step in SUITES["s1"].steps():
        line = next(x for x in out.splitlines() if x.split()[:1] == [step.name])
        assert f"limit {step.limit_s:>4}s" in line
    assert "erase_tune start --space search_spaces/dlrm.yaml --study dlrm" in out and "--time-budget 6m" in out
    assert f"at most {sum(s.limit_s for s in SUITES['s1'].steps())}s in all" in out


def test_a_suite_runs_its_steps_under_their_limits_and_packs_them(tmp_path, capsys):
    import tarfile

    slow = Step("slow", 1, "", ("{py}", "-c", "import time; print('started', flush=True); time.sleep(30)"))
    quick = Step("quick", 30, "", ("{py}", "-c", "print('{word}')"))
    suite = Suite("t", "test", ("(owed: a test)",), ((((slow,), (quick,))),) + seq(quick), variables={"word": "hi"})
    assert run_suite(suite, tmp_path) == 0
    out = capsys.readouterr().out
    summary = (tmp_path / "work/summary.txt").read_text().splitlines()
    assert sorted(line.split()[1] for line in summary) == ["rc=0", "rc=0", "rc=124"]
    slow_log = (tmp_path / "work/slow.log").read_text()
    assert slow_log.startswith("started\n") and "hi" in (tmp_path / "work/quick.log").read_text()
    # the step stopped by its limit says how the SIGTERM to its process group ended it: here the
    # signal's own exit status (-15 from Popen: no handler), within the grace
    assert "SIGTERM to the process group; exit -15" in slow_log, slow_log
    with tarfile.open(tmp_path / "t.tar.gz") as tar:
        assert {"work/summary.txt", "work/slow.log", "work/gpu.txt"} <= set(tar.getnames())
    assert "slow rc=124" in out and "== slow.log" in out


def test_the_package_imports_nothing_of_the_service():
    code = ("import sys, erase_tune.benchmarks as b; b.load_cases(); import erase_tune.benchmarks.runner, "
            "erase_tune.benchmarks.suites; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('optuna', 'ray', 'sqlalchemy', 'alembic') or m.startswith(('erase_tune.tune', 'erase_tune.store'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]
