"""``--ray-address`` joins an existing Ray cluster: a head started with ``ray start``, a driver
in another process, trials in the cluster's own worker processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.tune.conftest import ROOT, SMOKE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head in its own process group; yields the address it advertises."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_cli, "the ray command line ships with ray"
    log = tmp_path / "head.log"
    # Ray 2.60 clusters require an auth token by default; this throwaway local cluster opts out
    # (a real deployment gives the driver the cluster's token instead: deploy/README.md).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    with open(log, "w") as out:
        head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=2",
             "--include-dashboard=false", "--disable-usage-stats"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    found = None
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"ray start --address='([^']+)'", log.read_text())):
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        yield found.group(1)
    finally:
        # The whole group (raylet, GCS, workers) goes; SIGTERM would drain for 30 s first.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        # `ray start` records the cluster for later `ray.init()` calls; it is gone now.
        current = Path("/tmp/ray/ray_current_cluster")
        if found and current.exists() and current.read_text().strip() == found.group(1):
            current.unlink()


def test_start_joins_an_existing_cluster(ray_head, tmp_path):
    url = f"sqlite:///{tmp_path / 'joined.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "erase_tune", "start", "--space", str(SMOKE), "--study", "joined", "--trials", "3",
         "--storage", url, "--ray-address", ray_head],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"joined {ray_head}" in done.stdout
    trials = optuna.load_study(study_name="joined", storage=url).get_trials()
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
    host = ray_head.split(":")[0]
    assert all(t.user_attrs["ray_node"].startswith(f"{host}/") for t in trials)
