"""Where the host time of one placement goes: cProfile over the same steps of the engine with
an empty plan and with one module whose work is negligible placed on a side stream.

    python scripts/host_profile.py --workload dlrm --arg batch=4096 --device cuda [--module top_l.9]

Then an attribution pass: the placement, and a second engine with an empty plan (what two runs of
the same work differ by: the resolution of the figures), each against the empty plan, alternating
step by step (the process's CPU, and the training thread's own).
Prints, per variant, the process CPU µs per step (device waits left out: erase_tune.measure.hostcpu)
and the functions whose own time per step differs most between the two (profiled steps are
slower than real ones; read the differences, not the absolute figures).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from erase_tune.measure.hostcpu import blocking_sync, host_cpu_interleaved, host_tax  # noqa: E402
from erase_tune.runtime import ErasePlan, Placement  # noqa: E402
from erase_tune.runtime.device import resolve_device  # noqa: E402
from erase_tune.trial import GRAPH_WARMUP, Variant, build_engine  # noqa: E402
from erase_tune.workloads import get_workload, workload_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="dlrm")
    ap.add_argument("--arg", action="append", default=[])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--module", default="auto", help="the placed module (auto: the model's last leaf)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=300, help="rounds of the attribution pass (0: none)")
    a = ap.parse_args()
    args = workload_args(a.arg)
    wl = get_workload(a.workload, args)
    device = resolve_device(a.device)
    torch.manual_seed(0)
    data, init = wl.make_data(device), wl.build_model()
    module = a.module if a.module != "auto" else [n for n, m in init.named_modules() if n and not list(m.children())][-1]
    plans = {"empty plan": ErasePlan(),
             f"{module} placed": ErasePlan(placements=(Placement(module=module, stream=1),), num_streams=1)}
    variants = {k: Variant(plan=p, engine=build_engine(wl, p, init, data, device), data=data) for k, p in plans.items()}
    stats = {}
    with blocking_sync(device) as (_, how):
        for name, v in variants.items():
            for i in range(GRAPH_WARMUP + 5):
                v(i)
        for rep in range(2):  # unprofiled CPU time, twice, alternating
            for name, v in variants.items():
                c0 = time.process_time()
                for i in range(a.steps):
                    v(i)
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                print(f"{name:<24} {(time.process_time() - c0) / a.steps * 1e6:>8.0f} CPU µs/step (unprofiled, pass {rep})")
        for name, v in variants.items():
            prof = cProfile.Profile()
            prof.enable()
            for i in range(a.steps):
                v(i)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            prof.disable()
            stats[name] = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, nc, tt, ct, callers)
    print(how)
    if a.rounds:
        empty = plans["empty plan"]
        attribute(variants, device, a.rounds,
                  Variant(plan=empty, engine=build_engine(wl, empty, init, data, device), data=data))
    (ea, eb) = stats.values()
    keys = set(ea) | set(eb)

    def per_step(st, k):
        v = st.get(k)
        return (v[2] / a.steps * 1e6, v[1] / a.steps) if v else (0.0, 0.0)
    rows = sorted(keys, key=lambda k: -(per_step(eb, k)[0] - per_step(ea, k)[0]))
    print(f"{'function':<70} {'µs/step empty':>14} {'µs/step placed':>15} {'calls/step':>16}")
    for k in rows[:25]:
        (ta, na), (tb, nb) = per_step(ea, k), per_step(eb, k)
        print(f"{(Path(k[0]).name + ':' + str(k[1]) + ' ' + k[2])[:70]:<70} {ta:>14.1f} {tb:>15.1f} {f'{na:.0f} -> {nb:.0f}':>16}")
    for name, st in stats.items():
        print(f"{name}: {sum(v[2] for v in st.values()) / a.steps * 1e6:.0f} µs/step profiled, "
              f"{sum(v[1] for v in st.values()) / a.steps:.0f} calls/step")


def attribute(variants: dict, device, rounds: int, again: Variant) -> None:
    """CPU µs/step over the empty plan, the variants alternating step by step: the placement,
    and ``again``, a second engine with an empty plan over the same model and data (an A/A pair)."""
    empty, placed = variants.values()
    for i in range(GRAPH_WARMUP + 5):
        again(i)
    runners = {"empty plan": empty, "placed": placed, "empty plan, a second engine (A/A)": again}
    cpu = host_cpu_interleaved(runners, device=device, warmup_steps=2, windows=rounds, window_steps=1,
                               start_step=10_000)
    print(f"attribution: CPU µs/step, {rounds} rounds alternating step by step; tax = median of the difference "
          "to the empty plan in the same round")
    for name in runners:
        m, lo, hi = host_tax(cpu, name, "empty plan")
        t, _, _ = host_tax(cpu, name, "empty plan", main_thread=True)
        print(f"  {name:<34} {cpu.median_us(name):>8,.0f} µs   tax {m:+7,.0f}   training thread's {t:+7,.0f}")



if __name__ == "__main__":
    main()
