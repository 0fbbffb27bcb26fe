"""Where the host time of one placement goes: cProfile over the same steps of the engine with
an empty plan and with one module whose work is negligible placed on a side stream.

    python -m erase_tune.benchmarks host_profile --out DIR --workload dlrm --arg batch=4096 --device cuda \
        [--module top_l.9]
    python -m erase_tune.benchmarks host_profile --out DIR --tag cut --workload dlrm --arg batch=4096 \
        --device cuda --cut bot_l

(recorded with scripts/host_profile.py, now this case.)

With ``--cut``, the same for one blocking cut: the engine detaching the module (main stream) against
the plain loop doing the cut's work by hand (the module detached, its aux head, the local loss's
backward at once), so what remains is the engine's own cost beyond the head.

Then an attribution pass: the variant, and a second copy of the base (what two runs of the same
work differ by: the resolution of the figures), each against the base, alternating step by step
(the process's CPU, and the training thread's own).
Prints, per variant, the process CPU µs per step (device waits left out: erase_tune.measure.hostcpu)
and the functions whose own time per step differs most between the two (profiled steps are
slower than real ones; read the differences, not the absolute figures).
"""

from __future__ import annotations

import cProfile
import dataclasses
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.benchmarks.host_table import WorkloadOptions, _Plain, _Start  # the plain loop, with a cut's work by hand
from erase_tune.measure.hostcpu import blocking_sync, host_cpu_interleaved, host_tax
from erase_tune.measure.timing import ORDERS
from erase_tune.measure.trial import GRAPH_WARMUP, Variant, build_engine
from erase_tune.runtime import Cut, ErasePlan, Placement


@dataclasses.dataclass
class Options(WorkloadOptions):
    module: str = opt("auto", "the placed module (auto: the model's last leaf)")
    cut: str | None = opt(None, "profile a blocking cut of this module against its work done by hand")
    order: str = opt("rotate", "runners' order in each round of the attribution", choices=ORDERS)
    steps: int = opt(150, "profiled steps per variant")
    rounds: int = opt(300, "rounds of the attribution pass (0: none)")


def _variants(a: Options, wl, init, data, device, module: str) -> tuple[dict[str, Any], Callable[[], Any]]:
    """The two variants profiled, base first (the empty plan and ``module`` placed, or the plain
    loop with the cut's work by hand and the engine's blocking cut), and a maker of a second copy
    of the base (the A/A pair of the attribution)."""
    if a.cut is None:
        plans = {"empty plan": ErasePlan(),
                 f"{module} placed": ErasePlan(placements=(Placement(module=module, stream=1),), num_streams=1)}
        variants = {k: Variant(plan=p, engine=build_engine(wl, p, init, data, device), data=data) for k, p in plans.items()}
        again = lambda: Variant(plan=plans["empty plan"], engine=build_engine(wl, plans["empty plan"], init, data, device),  # noqa: E731
                                data=data)
    else:
        plan = ErasePlan(cuts=(Cut(module=a.cut),))
        cut = Variant(plan=plan, engine=build_engine(wl, plan, init, data, device), data=data)
        head = (a.cut, cut.engine.heads[a.cut], plan.cuts[0].aux_weight)
        again = lambda: _Plain(_Start(wl, init, data, device), head=head, blocking=True)  # noqa: E731
        variants = {"by hand": again(), f"{a.cut} detached, blocking": cut}
    return variants, again


def _function_table(stats: dict[str, dict], variants: dict[str, Any], steps: int, functions: list[dict]) -> list[str]:
    """The functions whose own time per step differs most between the two variants (what the
    second adds most, then what it saves most), appended to ``functions`` and as table lines,
    then each variant's profiled totals."""
    (ea, eb) = stats.values()
    keys = set(ea) | set(eb)

    def per_step(st, k):
        v = st.get(k)
        return (v[2] / steps * 1e6, v[1] / steps) if v else (0.0, 0.0)
    rows = sorted(keys, key=lambda k: -(per_step(eb, k)[0] - per_step(ea, k)[0]))
    base, other = (f"µs/step {n.split(' ')[-1]}"[:15] for n in variants)
    table = [f"{'function':<70} {base:>14} {other:>15} {'calls/step':>16}"]
    for k in rows[:25] + rows[-8:]:  # what the variant adds most, then what it saves most
        (ta, na), (tb, nb) = per_step(ea, k), per_step(eb, k)
        fn = (Path(k[0]).name + ':' + str(k[1]) + ' ' + k[2])[:70]
        functions.append({"function": fn, "us_per_step": [ta, tb], "calls_per_step": [na, nb]})
        table.append(f"{fn:<70} {ta:>14.1f} {tb:>15.1f} {f'{na:.0f} -> {nb:.0f}':>16}")
    for name, st in stats.items():
        table.append(f"{name}: {sum(v[2] for v in st.values()) / steps * 1e6:.0f} µs/step profiled, "
                     f"{sum(v[1] for v in st.values()) / steps:.0f} calls/step")
    return table


@case("host_profile", Options, cuda="optional", recorded_with="scripts/host_profile.py",
      description="where one placement's (or one blocking cut's) host time goes: cProfile, call counts, an A/A attribution",
      figures=("00.5 After the engine split (where a placement's host time goes)",
               "00.6 The stream fast path (attribution)", "00.7 A lean join (attribution with an A/A pair)",
               "00.8 The lean join verified and shipped (attribution; what each variant calls, counted)"))
def host_profile(a: Options, ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = {"unprofiled_cpu_us": {}, "functions": []}
    start = a.start()
    wl, init, data, device = start.workload, start.init, start.data, start.device
    module = a.module if a.module != "auto" else [n for n, m in init.named_modules() if n and not list(m.children())][-1]
    variants, again = _variants(a, wl, init, data, device, module)
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
                us = (time.process_time() - c0) / a.steps * 1e6
                result["unprofiled_cpu_us"].setdefault(name, []).append(us)
                print(f"{name:<24} {us:>8.0f} CPU µs/step (unprofiled, pass {rep})")
        for name, v in variants.items():
            prof = cProfile.Profile()
            prof.enable()
            for i in range(a.steps):
                v(i)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            prof.disable()
            stats[name] = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, nc, tt, ct, callers)
    print(how)
    result["how"] = how
    result["calls"] = calls(variants, device, steps=10)
    if a.rounds:
        result["attribution"] = attribute(variants, device, a.rounds, again(), a.order)
    table = _function_table(stats, variants, a.steps, result["functions"])
    result["table"] = "\n".join(table)
    return result


def calls(variants: dict, device, steps: int) -> dict[str, list[float]]:
    """What the second variant calls per step that the first does not, counted by torch's profiler
    over ``steps`` steps each: torch operators and, on CUDA, the CUDA runtime calls (launches,
    event records and waits, allocations). Counts, not times: exact where cProfile's times are not."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    counted = []
    for v in variants.values():
        with profile(activities=activities) as prof:
            for i in range(steps):
                v(20_000 + i)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
        counted.append({e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()})
    base, other = counted
    names = list(variants)
    rows = sorted(((other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]) / steps, k) for k in set(base) | set(other))
    print(f"calls per step, {names[1]} against {names[0]} (torch profiler, {steps} steps each): the differences")
    counts = {}
    for diff, k in sorted(rows, key=lambda r: -abs(r[0])):
        if diff:
            counts[k] = [base.get(k, (0, 0))[0] / steps, other.get(k, (0, 0))[0] / steps]
            print(f"  {k[:70]:<70} {counts[k][0]:>7.1f} -> {counts[k][1]:>7.1f}")
    return counts


def attribute(variants: dict, device, rounds: int, again, order: str) -> dict[str, dict[str, float]]:
    """CPU µs/step over the base (the first variant), the variants alternating step by step: the
    other variant, and ``again``, a second copy of the base over the same model and data (an A/A pair)."""
    (base, first), (name, other) = variants.items()
    for i in range(GRAPH_WARMUP + 5):
        again(i)
    runners = {base: first, name: other, f"{base}, a second copy (A/A)": again}
    cpu = host_cpu_interleaved(runners, device=device, warmup_steps=2, windows=rounds, window_steps=1,
                               start_step=10_000, order=order)
    print(f"attribution: CPU µs/step, {rounds} rounds alternating step by step ({cpu.how}); tax = median of the difference "
          f"to the {base} in the same round")
    out = {}
    for name in runners:
        m, lo, hi = host_tax(cpu, name, base)
        t, _, _ = host_tax(cpu, name, base, main_thread=True)
        out[name] = {"cpu_us": cpu.median_us(name), "tax_us": [m, lo, hi], "main_thread_tax_us": t}
        print(f"  {name:<34} {cpu.median_us(name):>8,.0f} µs   tax {m:+7,.0f}   training thread's {t:+7,.0f}")
    return out
