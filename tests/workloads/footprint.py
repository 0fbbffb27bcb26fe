"""Run workload calls in a fresh interpreter and report each one's CPU time and peak memory.

Time is the process's CPU time (``time.process_time``), not the wall clock: on a loaded
machine a call waits for a core as long as the other processes hold it, which says nothing of
the call's own cost; its CPU time does not stretch so.

Memory a call allocates through torch is invisible to tracemalloc (torch's CPU allocator is
not Python's), so the measure is the process's peak resident set (``ru_maxrss``) before and
after each call. A fresh process keeps earlier tests' peaks from hiding a call's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, resource, sys, time
import torch
from erase_tune.errors import WorkloadError
from erase_tune.workloads import BUILTINS, get_workload

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB

for name in BUILTINS:  # import each built-in (and what it imports) before measuring
    get_workload(name).example(torch.device("cpu"))
results = []
for case in json.loads(sys.argv[1]):
    before, started = peak(), time.process_time()
    error = None
    try:
        workload = get_workload(case["name"], case["args"])
        if case["example"]:
            inputs, target = workload.example(torch.device("cpu"))
    except WorkloadError as exc:
        error = str(exc)
    results.append({"cpu_seconds": time.process_time() - started, "grew": peak() - before, "error": error})
print(json.dumps(results))
"""


def measure(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case ``{"name", "args", "example": bool}``: build the workload (and, if
    ``example``, its example batch on the CPU) in one fresh process, in order. Returns per
    case ``cpu_seconds``, ``grew`` (bytes the peak resident set grew by) and ``error`` (the
    WorkloadError's message, or None)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
