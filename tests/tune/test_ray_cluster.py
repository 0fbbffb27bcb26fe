"""A real Ray cluster of processes, started with the Ray CLI, the way a RayJob runs a job.

A head (``ray start --head``, with the job server) and a second node (``ray start
--address``); the job is submitted with ``ray job submit --working-dir`` and runs the user
workload package of docs/workloads.md, which is installed on no node: only the working dir
carries it. The job stores into PostgreSQL, trials run on both nodes (their node ids are
recorded), the second node is stopped mid-job (a trial it held is retried on the head;
nothing is lost), the job confirms its front, and a second job exports the plan.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from ray.job_submission import JobStatus, JobSubmissionClient

from erase_tune.runtime import ErasePlan
from erase_tune.store import Store
from erase_tune.tune.execute.executor import RAY_START_TIMED_OUT
from tests.tune.conftest import ROOT
from tests.tune.test_workloads_doc import doc_files

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
# Ray 2.60 clusters require an auth token by default; this throwaway local cluster opts out
# (a real deployment gives the driver the cluster's token: deploy/README.md).
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
ENV.pop("RAY_ADDRESS", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], log: Path) -> subprocess.Popen:
    # Each node's agents on ports of their own: the defaults (52365 and others) are fixed, so a
    # second node on this host, or a local Ray another test left running, would hold them and
    # the job server would wait for an agent that never starts.
    ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}"]
    with open(log, "w") as out:
        return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *ports, *args], stdout=out,
                                stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def _node(args: list[str], log: Path, up: Callable[[], bool], deadline: float, procs: list[subprocess.Popen]) -> None:
    """Start a node and wait until ``up()``. Ray's own start-up gives its raylet a fixed 30 s to
    register ("timed out during startup", seen here on a loaded machine): started once more then,
    as erase-tune's private local Ray is (erase_tune.tune.execute.executor.RAY_START_TIMED_OUT)."""
    for attempt in (1, 2):
        proc = _ray_start(args, log)
        procs.append(proc)
        while not up():
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        else:
            return
        said = log.read_text()
        assert attempt == 1 and RAY_START_TIMED_OUT in said, said[-3000:]
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: raylet, GCS, agents, workers
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _nodes_alive(address: str) -> int:
    code = ("import ray; ray.init(address=%r, logging_level='error');"
            "print(sum(n['Alive'] for n in ray.nodes()))" % address)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0


def _submit(job_address: str, work: Path, entry: str) -> str:
    """``ray job submit --working-dir`` as a user types it (not waiting: the log stream of a
    waiting submit can stall while the job goes on); returns the job's submission id."""
    job = f"erase-tune-{uuid.uuid4().hex[:12]}"
    done = subprocess.run([RAY, "job", "submit", "--address", job_address, "--submission-id", job, "--no-wait",
                           "--working-dir", str(work), "--", "sh", "-c", entry],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return job


def _finish(client: JobSubmissionClient, job: str, timeout: float) -> tuple[JobStatus, str]:
    """The job's final status and its whole log; a job still running after ``timeout`` seconds
    is stopped and fails the test with its log (where it stood, not only that it ran long)."""
    deadline = time.monotonic() + timeout
    while not (status := client.get_job_status(job)).is_terminal():
        if time.monotonic() > deadline:
            log = client.get_job_logs(job)
            client.stop_job(job)
            pytest.fail(f"the job still ran {timeout:.0f}s later ({status}); its log:\n{log[-8000:]}")
        time.sleep(1)
    return status, client.get_job_logs(job)


@pytest.fixture
def two_nodes(tmp_path):
    """Head (1 CPU, job server) and a worker node (1 CPU); yields (gcs address, job address, node 2)."""
    assert RAY, "the ray command line ships with ray"
    gcs_port, dash_port = _free_port(), _free_port()
    # A session directory of its own (short: Ray's socket paths must fit in 107 bytes). Ray's job
    # server gives a job's driver the address it reads from <temp dir>/ray_current_cluster, which
    # in the shared /tmp/ray names whichever Ray on this host started last: beside other test
    # processes' local Rays, the job joined one of those and was refused.
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    head = ["--head", f"--port={gcs_port}", "--num-cpus=1", "--include-dashboard=true", f"--temp-dir={temp}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}"]
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 180
        found = None

        def head_up() -> bool:
            nonlocal found
            found = re.search(r"ray start --address='([^']+)'", (tmp_path / "head.log").read_text())
            return found is not None

        _node(head, tmp_path / "head.log", head_up, deadline, procs)
        gcs = found.group(1)
        _node([f"--address={gcs}", "--num-cpus=1"], tmp_path / "node2.log", lambda: _nodes_alive(gcs) >= 2, deadline,
              procs)
        node2 = procs[-1]
        job_address = f"http://127.0.0.1:{dash_port}"
        # The job server answers before its agent can take a job ("No available agent to submit
        # job, please try again later"): a trivial job that runs is the readiness probe.
        while (probe := subprocess.run([RAY, "job", "submit", "--address", job_address, "--", "true"], env=ENV,
                                       capture_output=True, text=True, timeout=120)).returncode != 0:
            assert time.monotonic() < deadline, f"the job server took no job: {probe.stdout[-2000:]}{probe.stderr[-2000:]}"
            time.sleep(1)
        yield gcs, job_address, node2
    finally:
        for p in procs:
            _kill(p)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_on_two_nodes_with_postgres(two_nodes, pg_url, tmp_path, monkeypatch):
    gcs, job_address, node2 = two_nodes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the job client here, as ENV for the ray CLI
    work = tmp_path / "job"
    for rel, text in doc_files().items():  # the user's package, exactly as docs/workloads.md writes it
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    space = yaml.safe_load((work / "ranker.yaml").read_text())
    space["trials"] = 8
    space["budget"] = {**space.get("budget", {}), "quality_steps": 150}
    (work / "ranker.yaml").write_text(yaml.safe_dump(space))
    # What a RayJob's entrypoint runs. The export is a job of its own: Ray deletes a job's
    # working dir when the first Ray driver started inside it exits, so nothing can follow
    # `start` in the same entrypoint (deploy/README.md says so too).
    entry = (f"{sys.executable} -m erase_tune db upgrade --storage {pg_url}"
             f" && {sys.executable} -m erase_tune start --space ranker.yaml --study rayjob --storage {pg_url} --repeats 3")
    client = JobSubmissionClient(job_address)
    job = _submit(job_address, work, entry)

    # Once each node has measured a trial, stop the second node (SIGKILL: a lost machine).
    nodes: set[str] = set()
    deadline = time.monotonic() + 400
    while len(nodes) < 2 and time.monotonic() < deadline and not client.get_job_status(job).is_terminal():
        try:
            trials = optuna.load_study(study_name="rayjob", storage=pg_url).get_trials()
            nodes = {t.user_attrs["ray_node"] for t in trials if t.state == TrialState.COMPLETE}
        except (KeyError, Exception):  # noqa: BLE001 - the study may not exist yet
            pass
        time.sleep(1)
    if len(nodes) < 2:  # the job ended (or stalled) before both nodes measured: show what it printed
        status = client.get_job_status(job)
        client.stop_job(job)
        pytest.fail(f"trials ran on {nodes}; job {status}; job log:\n{client.get_job_logs(job)[-4000:]}")
    os.killpg(node2.pid, signal.SIGKILL)

    status, out = _finish(client, job, 600)
    assert status == JobStatus.SUCCEEDED, out[-4000:]
    assert "re-measured" in out  # the end of start confirmed the front
    export = (f"{sys.executable} -m erase_tune export --study rayjob --storage {pg_url} --repeats 3 --force -o best.yaml"
              f" && cp best.yaml {tmp_path / 'best.yaml'}")
    status, out = _finish(client, _submit(job_address, work, export), 600)
    assert status == JobStatus.SUCCEEDED, out[-4000:]
    trials = optuna.load_study(study_name="rayjob", storage=pg_url).get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 8
    with Store(pg_url) as store:
        job_row = store.get_job("rayjob")
        assert job_row.status == "finished"
        assert all(store.outcome(job_row, t.number).status == "complete" for t in measured)
    plan = ErasePlan.load(tmp_path / "best.yaml")
    assert plan.provenance["study"] == "rayjob" and plan.provenance["workload"] == "my_ranker:workload"
