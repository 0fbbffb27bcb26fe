"""What a step does on the host: CUDA runtime calls that block it, per variant, from a profiler trace.

A step that synchronizes with the device (a sparse-gradient optimizer that must learn an
output size, an ``.item()``) exposes every kernel and cross-stream wait queued before the
sync as host time; without syncs, extra side-stream work overlaps the host. This counts, for
a few steps of each variant, the blocking runtime calls (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, device-to-host ``cudaMemcpy*``), the CPU
time spent in them, and the whole CPU time of the step.

    python scripts/host_trace.py --workload dlrm --arg batch=4096 --device cuda --out trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement  # noqa: E402
from erase_tune.runtime.device import resolve_device, synchronize  # noqa: E402
from erase_tune.measure.trial import Variant, build_engine  # noqa: E402
from erase_tune.workloads import get_workload, workload_args  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="dlrm")
    ap.add_argument("--arg", action="append", default=[])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--place", default="bot_l")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    args = workload_args(a.arg)
    workload, device = get_workload(a.workload, args), resolve_device(a.device)
    torch.manual_seed(0)
    data, init = workload.make_data(device), workload.build_model()
    p = a.place
    plans = {"empty plan": ErasePlan(),
             f"{p} placed": ErasePlan(placements=(Placement(module=p, stream=1),), num_streams=1),
             f"{p} detached, blocking": ErasePlan(cuts=(Cut(module=p),)),
             f"{p} graphed": ErasePlan(graphs=(Graphed(module=p),))}
    rows = {}
    for name, plan in plans.items():
        v = Variant(plan=plan, engine=build_engine(workload, plan, init, data, device), data=data)
        for s in range(8):
            v(s)
        synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for s in range(8, 8 + a.steps):
                v(s)
            host = (time.perf_counter() - t0) / a.steps
            synchronize(device)
        calls: dict[str, list[float]] = {}
        for e in prof.events():
            if any(e.name.startswith(b) for b in BLOCKING):
                key = e.name if not e.name.startswith("cudaMemcpy") else f"{e.name}"
                calls.setdefault(key, []).append(e.cpu_time_total)
        rows[name] = {"host_ms_per_step": host * 1e3,
                      "blocking_calls_per_step": {k: len(t) / a.steps for k, t in calls.items()},
                      "blocking_ms_per_step": sum(sum(t) for t in calls.values()) / a.steps / 1e3}
        v.engine.close()
        del v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, r in rows.items():
        per = ", ".join(f"{k} {n:g}" for k, n in sorted(r["blocking_calls_per_step"].items()))
        print(f"{name:<28} host {r['host_ms_per_step']:6.2f} ms/step, of which blocked "
              f"{r['blocking_ms_per_step']:5.2f} ms; per step: {per or 'no blocking call'}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))



if __name__ == "__main__":
    main()
