"""What the CLI writes when its output cannot take it: a terminal encoding without the
characters of a name, a full disk behind a redirection. Real commands in a fresh process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "search_spaces" / "ctr-smoke.yaml"


def _run(args: list[str], tmp_path: Path, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "erase_tune", *args], cwd=tmp_path, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_name_the_terminal_cannot_encode_is_escaped_not_a_traceback(tmp_path):
    space = tmp_path / "étude.yaml"
    shutil.copy(SMOKE, space)
    out = _run(["check", "--space", space.name], tmp_path, PYTHONIOENCODING="ascii")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "\\xe9tude.yaml" in out.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_onto_a_full_disk_is_one_line_and_exit_2(tmp_path):
    with open("/dev/full", "w") as full:
        out = _run(["check", "--space", str(SMOKE), "--json"], tmp_path, stdout=full)
    assert out.returncode == 2
    assert out.stderr == ("erase-tune: error: cannot write the command's output: No space left on device "
                          "(free some space or write elsewhere)\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["start", "--help"]])
def test_help_onto_a_full_disk_is_one_line_and_exit_2(tmp_path, argv):
    """Was: exit 0, the text lost (argparse exits before the command's own flush)."""
    with open("/dev/full", "w") as full:
        out = _run(argv, tmp_path, stdout=full)
    assert out.returncode == 2
    assert out.stderr == ("erase-tune: error: cannot write the command's output: No space left on device "
                          "(free some space or write elsewhere)\n")
