"""A private local Ray whose start-up timed out is started once more, and what the timed-out
start left running is killed (real Ray; the first start is made to time out as Ray's own does,
with a GCS-like child process left behind, because a machine busy enough to take Ray past its
30 s cannot be made on purpose)."""

from __future__ import annotations

import subprocess
import sys

from tests.tune.conftest import ROOT

SCRIPT = r"""
import subprocess, sys, psutil, ray
from erase_tune.tune.execute import executor

real_init, calls, left = ray.init, [], []

def init(**kwargs):
    calls.append(kwargs["address"])
    if len(calls) == 1:  # what a timed-out start leaves: a child process, and Ray's exception
        left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")
    return real_init(**kwargs)

ray.init = init
executor._start_ray(ray, None, {})
left[0].wait(timeout=10)
print(calls, ray.is_initialized(), left[0].returncode, ray.cluster_resources().get("CPU", 0) > 0)

@ray.remote(num_cpus=0)
class Probe:  # of the default runtime environment: it would take a prestarted idle worker
    def ping(self):
        return 1

probe = Probe.remote()
ray.get(probe.ping.remote(), timeout=120)
def titles():
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out
print("idle workers:", sum("ray::IDLE" in t for t in titles()), "probe:", sum("ray::Probe" in t for t in titles()))
import base64, json  # the settings Ray's GCS was started with (its raylet takes them from there)
gcs = next(t for t in titles() if "gcs_server" in t.split(" ")[0])
told = json.loads(base64.b64decode(next(a for a in gcs.split(" ") if a.startswith("--config_list=")).split("=", 1)[1]))
print("metrics:", told.get("enable_metrics_collection"))
ray.shutdown()
"""


def test_a_timed_out_ray_start_is_retried_once_and_its_leftovers_killed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    started, workers, metrics = done.stdout.strip().splitlines()[-3:]
    assert started == "['local', 'local'] True -9 True"
    # No idle worker was started ahead of need (Ray's default starts one per CPU; trial actors
    # have their own runtime environment and could use none of them).
    assert workers == "idle workers: 0 probe: 1", workers
    assert metrics == "metrics: False", metrics  # no dashboard shows them: not collected
    assert "Ray's start-up timed out" in done.stderr and "starting a local Ray once more" in done.stderr


def test_a_second_timed_out_start_is_one_error_and_leaves_nothing_running():
    script = SCRIPT.replace("if len(calls) == 1:", "if True:").replace(
        "executor._start_ray(ray, None, {})",
        "try:\n    executor._start_ray(ray, None, {})\nexcept Exception as e:\n"
        "    print(type(e).__name__, e)\n    print([p.wait(timeout=10) for p in left], calls)\n    sys.exit(0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    error, killed = done.stdout.strip().splitlines()[-2:]  # (it exits before the probe)
    assert error.startswith("EraseTuneError cannot start or join Ray locally: The current node timed out during startup")
    assert killed == "[-9, -9] ['local', 'local']"
