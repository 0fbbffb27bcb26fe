"""``erase-tune dashboard`` serves the real optuna-dashboard on a job's storage: the study
is listed, its two objectives carry their names, and it listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from tests.tune.conftest import ROOT, run_cli
from tests.tune.faulty import write_space


@pytest.fixture(scope="module")
def finished_study(ray_cluster, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("dash")
    url = f"sqlite:///{tmp / 'dash.db'}"
    space = write_space(tmp / "dash.yaml", trials=2, budget={"noise_repeats": 1})  # with a noise floor
    assert run_cli("start", "--space", space, "--study", "dash", "--storage", url, "--slots", 1) == 0
    return url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        assert r.status == 200
        return json.load(r)


@pytest.fixture(scope="module")
def dashboard(finished_study) -> Iterator[tuple[subprocess.Popen, int]]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "erase_tune", "dashboard", "--storage", finished_study,
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"dashboard exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                _get(port, "/api/studies")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail("dashboard did not answer within 30 s")
                time.sleep(0.3)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_study_is_listed_with_named_objectives(dashboard):
    _, port = dashboard
    summaries = _get(port, "/api/studies")["study_summaries"]
    (study,) = [s for s in summaries if s["study_name"] == "dash"]
    assert study["directions"] == ["maximize", "minimize"]

    detail = _get(port, f"/api/studies/{study['study_id']}")
    assert detail["name"] == "dash"
    assert detail["objective_names"] == ["qps_gain", "ne_gap"]
    assert len(detail["trials"]) == 2
    assert all(t["state"] == "Complete" for t in detail["trials"])
    # The noise floor of the NE gap is a study attribute the dashboard lists, and each trial's
    # constraint is its gap against the budget plus that band.
    attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
    band = float(attrs["ne_noise_band"])
    assert band >= 0 and "noise_floor" in attrs
    for t in detail["trials"]:
        values = t["values"]
        exact = {a["key"]: a["value"] for a in t["user_attrs"]}.get("exact") in (True, "true", "True")
        assert t["constraints"] == pytest.approx([-0.05 if exact else values[1] - (0.05 + band)])


def test_it_binds_to_loopback_only_by_default(dashboard):
    proc, port = dashboard
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" and addr.port == port for addr in listening), listening


@pytest.mark.parametrize("argv, needle", [
    (["--port", "70000"], "--port: 70000"),
    (["--storage", "postgresql+psycopg://u:s3cret@127.0.0.1:1/x"], "u:***@127.0.0.1:1"),
])
def test_a_bad_port_or_storage_is_one_line(capsys, argv, needle):
    assert run_cli("dashboard", *argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("erase-tune: error:") and needle in lines[0], captured.err
    assert "s3cret" not in captured.out + captured.err
