"""docs/workloads.md, followed literally: its files are written as they stand in the page,
its shell commands run as they stand (a private local Ray, SQLite), and the error it quotes
for a starving candidate is the one erase-tune prints. The cluster part of the page runs in
tests/tune/test_ray_cluster.py, with the same files."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import optuna
import yaml

from erase_tune.runtime import ErasePlan
from tests.tune.conftest import ROOT

DOC = ROOT / "docs" / "workloads.md"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
TORCHREC = "\n## 8. TorchRec models\n"  # its own test: tests/torchrec/test_workloads_doc.py


def page() -> str:
    """The page up to its TorchRec section."""
    return DOC.read_text().split(TORCHREC)[0]


def doc_files() -> dict[str, str]:
    """``path -> text`` of every code block that starts with ``# file: <path>``."""
    out = {}
    for _, body in BLOCK.findall(page()):
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            out[first.removeprefix("# file: ").strip()] = body
    return out


def doc_commands() -> list[str]:
    """Every line of the page's ``sh`` blocks, in order."""
    return [line for lang, body in BLOCK.findall(page()) if lang == "sh"
            for line in body.splitlines() if line.strip()]


def _write(where: Path) -> None:
    for rel, text in doc_files().items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "ERASE_TUNE_STORAGE")}
    # erase-tune itself is installed (as `pip install -e .` does); the user's package is not.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["ERASE_TUNE_JOURNAL_DIR"] = str(tmp_path / "journal")
    return env


def test_the_page_runs_as_written(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    _write(work)
    commands = doc_commands()
    assert [c.split()[:2] for c in commands] == [["python", "check_grads.py"], ["erase-tune", "trial"],
                                                 ["erase-tune", "check"], ["erase-tune", "start"],
                                                 ["erase-tune", "export"]]
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "python":
            argv[0] = sys.executable
        done = subprocess.run(argv, cwd=work, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if argv[0] == sys.executable:
            assert "gradients match the reference" in done.stdout
        if argv[1] == "check":  # the dry run: the page's candidates, screen and elements; nothing stored
            def same(lines: list[str]) -> list[str]:
                return [line for line in lines if line.startswith(("candidates", "  ", "screen:"))]

            assert same(done.stdout.splitlines()) == same(_quoted_check())
            assert not (work / "erase-tune.db").exists()

    trials = optuna.load_study(study_name="ranker", storage=f"sqlite:///{work / 'erase-tune.db'}").get_trials()
    assert sum(t.state.name == "COMPLETE" and "duplicate_of" not in t.user_attrs for t in trials) == 6
    plan = ErasePlan.load(work / "best.yaml")
    assert plan.provenance["workload"] == "my_ranker:workload" and "confirmed" in plan.provenance


def _quoted_check() -> list[str]:
    """The output of ``erase-tune check`` the page quotes (the block after its command)."""
    text, command = DOC.read_text(), "erase-tune check --space ranker.yaml\n```\n"
    return BLOCK.findall(text[text.index(command) + len(command):])[0][1].splitlines()


def test_the_quoted_refusal_is_what_erase_tune_prints(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    _write(work)
    space = yaml.safe_load((work / "ranker.yaml").read_text())
    space["cuts"]["candidates"] = ["bot_l", "top_l.0:2"]
    (work / "ranker-bad.yaml").write_text(yaml.safe_dump(space))
    done = subprocess.run(["erase-tune", "start", "--space", "ranker-bad.yaml", "--study", "bad"], cwd=work,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    quoted = next(line for line in DOC.read_text().splitlines() if line.startswith("erase-tune: error: ranker-bad"))
    assert done.stderr.strip() == quoted
    assert not (work / "erase-tune.db").exists()  # refused before anything was stored
