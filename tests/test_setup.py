"""The set-up `make test` runs on a fresh machine (scripts/setup.sh), step by step.

The PostgreSQL step is checked with stand-in ``pg_isready``/``pg_ctlcluster`` commands first
on PATH: the shared server other tests use is never stopped or started here. The stand-ins
record how they were called, so the test sees what the step would have run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def _step(tmp_path: Path, step: str, *, ready_after: int | None, root: bool = True,
          extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Source setup.sh and run one step with stand-ins: ``pg_isready`` answers once
    ``pg_ctlcluster`` was called and it has been asked ``ready_after`` times (never if None)."""
    bins = tmp_path / "bin"
    bins.mkdir(exist_ok=True)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    never = "false" if ready_after is None else "true"
    _stub(bins, "pg_isready", f'n=$(cat {state}/asked 2>/dev/null || echo 0); echo $((n+1)) > {state}/asked\n'
                              f'[ -f {state}/started ] && {never} && [ "$n" -ge {ready_after or 0} ]')
    _stub(bins, "pg_ctlcluster", f'echo "$@" >> {state}/ctl; touch {state}/started')
    _stub(bins, "id", 'if [ "$1" = -u ]; then echo ' + ("0" if root else "1000") + '; else echo someone; fi')
    extra = dict(extra_env or {})
    env = {**os.environ, "PG_START_WAIT_S": "3", **extra,
           "PATH": f"{bins}:{extra.get('PATH', os.environ['PATH'])}"}  # the stand-ins come first
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {SETUP}; {step}"], env=env, text=True,
                          capture_output=True, timeout=60)


def test_postgresql_step_starts_a_stopped_cluster_and_waits_for_it(tmp_path):
    if not Path("/etc/postgresql").is_dir():
        pytest.skip("no Debian PostgreSQL cluster configuration on this machine")
    done = _step(tmp_path, "setup_postgresql", ready_after=2)
    assert done.returncode == 0, done.stderr
    version = sorted(os.listdir("/etc/postgresql"), key=lambda v: [int(x) for x in v.split(".") if x.isdigit()])[-1]
    assert (tmp_path / "state" / "ctl").read_text().split() == ["--skip-systemctl-redirect", version, "main", "start"]
    assert f"starting cluster {version}/main" in done.stdout and "is up" in done.stdout


def test_postgresql_step_does_nothing_when_a_server_answers(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "started").touch()  # the stand-in server is up from the start
    done = _step(tmp_path, "setup_postgresql", ready_after=0)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "state" / "ctl").exists()
    assert "a server answers" in done.stdout


def test_postgresql_step_that_never_comes_up_fails_in_one_line(tmp_path):
    if not Path("/etc/postgresql").is_dir():
        pytest.skip("no Debian PostgreSQL cluster configuration on this machine")
    done = _step(tmp_path, "setup_postgresql", ready_after=None)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not answer on 127.0.0.1:5432 after 3 s" in lines[0], done.stderr


def test_postgresql_step_without_root_or_sudo_says_what_it_needs(tmp_path):
    if not Path("/etc/postgresql").is_dir():
        pytest.skip("no Debian PostgreSQL cluster configuration on this machine")
    # a PATH with the stand-ins and the basic tools, but no sudo
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("ls", "sort", "tail", "seq", "sleep", "cat", "touch", "bash"):
        found = shutil.which(tool)
        assert found, tool
        (tools / tool).symlink_to(found)
    done = _step(tmp_path, "setup_postgresql", ready_after=0, root=False, extra_env={"PATH": str(tools)})
    assert done.returncode == 1
    assert "needs root, sudo or the postgres user" in done.stderr
    assert not (tmp_path / "state" / "ctl").exists()


def test_setup_refuses_an_unknown_step_set():
    done = subprocess.run(["bash", str(SETUP), "everything"], text=True, capture_output=True, timeout=60)
    assert done.returncode == 2 and "unknown step set 'everything'" in done.stderr


def test_ci_runs_only_the_readme_test_command():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[-1].strip() == "make test"
    assert "make test" in (ROOT / "README.md").read_text()
    assert not any("pg_ctlcluster" in line or "install-browser" in line for line in lines)
