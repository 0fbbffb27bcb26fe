"""docs/workloads.md's TorchRec section, followed literally: its files are written as they
stand (with examples/train_torchrec.py copied next to them, as the page says), and its shell
commands run as they stand: the gradient check on KJT inputs, a tuning job on a private local
Ray with SQLite, the export, training with the exported plan, and the plan inside TorchRec's
TrainPipelineSparseDist. The one-line refusals the section describes are what erase-tune says."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("optuna")

from erase_tune.runtime import ErasePlan
from tests.tune.conftest import ROOT
from tests.tune.test_workloads_doc import BLOCK, DOC, TORCHREC, _env


def section() -> str:
    return DOC.read_text().split(TORCHREC)[1]


def files() -> dict[str, str]:
    out = {}
    for _, body in BLOCK.findall(section()):
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            out[first.removeprefix("# file: ").strip()] = body
    return out


def commands() -> list[str]:
    return [line for lang, body in BLOCK.findall(section()) if lang == "sh" for line in body.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("torchrec") / "project"
    work.mkdir()
    for rel, text in files().items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    shutil.copy(ROOT / "examples" / "train_torchrec.py", work / "train_torchrec.py")  # as the page says
    return work


def run(argv: list[str], work: Path, tmp: Path) -> subprocess.CompletedProcess:
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    env = _env(tmp)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT)  # this checkout's erase-tune, wherever the installed one points
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_torchrec_section_runs_as_written(project, tmp_path):
    cmds = commands()
    assert [c.split()[:2] for c in cmds] == [["python", "check_grads_torchrec.py"], ["erase-tune", "start"],
                                             ["erase-tune", "export"], ["python", "train_torchrec.py"],
                                             ["python", "pipeline_torchrec.py"]]
    out = {}
    for command in cmds:
        done = run(shlex.split(command), project, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        out[command.split()[1]] = done.stdout
    assert "gradients match the reference" in out["check_grads_torchrec.py"]
    plan = ErasePlan.load(project / "torchrec-best.yaml")
    assert plan.provenance["workload"] == "my_torchrec:workload"
    assert "(tables updated in backward)" in out["train_torchrec.py"]
    assert re.search(r"held-out NE [\d.]+ -> [\d.]+", out["train_torchrec.py"])  # rc 0: NE went down
    steps = plan.provenance["workload_args"]["steps"]
    assert re.search(rf"^{steps} pipelined steps under ", out["pipeline_torchrec.py"], re.M)


def test_what_the_section_says_is_refused(project, tmp_path):
    """The refusals the section quotes, from the CLI, one line each."""
    plan = project / "inter.yaml"
    plan.write_text("cuts:\n  - {module: inter_arch}\n")
    done = run(["erase-tune", "trial", "--workload", "my_torchrec:workload", "--plan", str(plan), "--device", "cpu"],
               project, tmp_path)
    error = [line for line in done.stderr.splitlines() if not line.startswith("W")]  # torch's own warnings
    assert done.returncode == 2 and len(error) == 1
    assert error[0].startswith(f"erase-tune: error: {plan}: plan leaves 8 parameters untrained: "
                               "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight, ")
    assert error[0].endswith("(cut 'inter_arch' detaches everything upstream of it)")
    said = " ".join(section().split())  # the page's words, unwrapped
    assert '"plan leaves 8 parameters untrained: sparse_arch.embedding_bag_collection.embedding_bags.t0.weight, …"' \
        in said


def test_the_data_note_speaks_of_the_workloads_own_arguments(project, tmp_path):
    """A trial that re-reads a user workload's batches says so without naming an argument
    (train_batches) the workload does not have."""
    plan = project / "dense.yaml"
    plan.write_text("cuts:\n  - {module: dense_arch}\n")
    done = run(["erase-tune", "trial", "--workload", "my_torchrec:workload", "--arg", "steps=4", "--plan", str(plan),
                "--device", "cpu", "--quality-steps", "10"], project, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    note = next(line for line in done.stdout.splitlines() if line.startswith("note: training read its batches"))
    assert "train_batches" not in note and "give the workload more training batches" in note
