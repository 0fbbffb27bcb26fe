"""Trials wait for GPUs to join the cluster (an autoscaling cluster may start with none),
for a bounded time that the error names; a real Ray cluster started with the Ray CLI, its GPU
node joining later (a node may declare GPU resources with ``ray start --num-gpus``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.tune.test_ray_cluster import ENV, _free_port, _nodes_alive, _ray_start


@pytest.fixture
def cpu_head(tmp_path):
    head = _ray_start(["--head", f"--port={_free_port()}", "--num-cpus=1", "--num-gpus=0",
                       "--include-dashboard=false"], tmp_path / "head.log")
    procs = [head]
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"ray start --address='([^']+)'", (tmp_path / "head.log").read_text())):
            assert head.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        yield found.group(1), procs
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists():
            current.unlink()


_WAIT = """
import json, sys, time
from erase_tune.errors import EraseTuneError
from erase_tune.tune.execute.executor import RayExecutor
executor = RayExecutor(sys.argv[1], workload="ctr", device="cuda", slots=1, gpu_wait_s=float(sys.argv[2]))
started = time.monotonic()
try:
    executor.wait_ready()
    print(json.dumps({"waited": time.monotonic() - started, "idle": executor.idle()}))
except EraseTuneError as e:
    print(json.dumps({"waited": time.monotonic() - started, "error": str(e)}))
finally:
    executor.close()
"""


def _wait_ready(address: str, wait_s: float) -> dict:
    """An executor joining ``address`` waits for a GPU slot, in a process of its own (the test
    process may be connected to the suite's shared Ray, which an executor would use instead)."""
    done = subprocess.run([sys.executable, "-c", _WAIT, address, str(wait_s)], capture_output=True, text=True,
                          env=ENV, timeout=wait_s + 120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_gpu_within_the_wait_is_one_line_naming_what_was_awaited(cpu_head):
    address, _ = cpu_head
    result = _wait_ready(address, 3)
    assert 3 <= result["waited"] < 30
    message = result["error"]
    assert "waited 3s for 1 GPU(s) on one node" in message and "the cluster has 0 GPUs" in message
    assert "--gpu-wait" in message and "\n" not in message


def test_a_gpu_node_joining_later_is_waited_for(cpu_head, tmp_path):
    address, procs = cpu_head

    def join() -> None:
        time.sleep(4)
        procs.append(_ray_start([f"--address={address}", "--num-cpus=1", "--num-gpus=1"], tmp_path / "gpu.log"))

    threading.Thread(target=join, daemon=True).start()
    result = _wait_ready(address, 120)  # returns once the GPU node has joined and the slot's worker started
    assert "error" not in result, result
    assert result["waited"] >= 3 and result["idle"] == 1
    assert _nodes_alive(address) == 2
