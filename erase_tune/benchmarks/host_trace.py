"""What a step does on the host: CUDA runtime calls that block it, per variant, from a profiler trace.

A step that synchronizes with the device (a sparse-gradient optimizer that must learn an
output size, an ``.item()``) exposes every kernel and cross-stream wait queued before the
sync as host time; without syncs, extra side-stream work overlaps the host. This counts, for
a few steps of each variant, the blocking runtime calls (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, device-to-host ``cudaMemcpy*``), the CPU
time spent in them, and the whole CPU time of the step.

    python -m erase_tune.benchmarks host_trace --out DIR --workload dlrm --arg batch=4096 --device cuda

(recorded with scripts/host_trace.py, now this case.)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.benchmarks.host_table import WorkloadOptions
from erase_tune.measure.trial import Variant, build_engine
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.device import synchronize

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclasses.dataclass
class Options(WorkloadOptions):
    place: str = opt("bot_l", "the module placed, cut and graphed")
    steps: int = opt(5, "profiled steps per variant")


@case("host_trace", Options, cuda="optional", recorded_with="scripts/host_trace.py",
      description="CUDA runtime calls that block the host per step, per variant, from a profiler trace",
      figures=("00.2a What the placement's cost is: a profiler trace of dlrm's step",))
def host_trace(a: Options, ctx: Context) -> dict[str, Any]:
    start = a.start()
    workload, init, data, device = start.workload, start.init, start.data, start.device
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
    table = []
    for name, r in rows.items():
        per = ", ".join(f"{k} {n:g}" for k, n in sorted(r["blocking_calls_per_step"].items()))
        table.append(f"{name:<28} host {r['host_ms_per_step']:6.2f} ms/step, of which blocked "
                     f"{r['blocking_ms_per_step']:5.2f} ms; per step: {per or 'no blocking call'}")
    return {"rows": rows, "table": "\n".join(table)}
