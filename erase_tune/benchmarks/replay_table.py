"""Measure every plan of a finite search space once, for replayed sampler studies.

    python -m erase_tune.benchmarks replay_table --out DIR --space search_spaces/ctr-replay.yaml \
        [--shard 0/2 --tag shard0] [--group 8] [--arg key=value ...]

(recorded with scripts/measure_replay_table.py, now this case; the table is the JSON's ``result``.)

The space must be finite: fixed λ (``aux_weight`` a number), ``streams: round_robin``, one
choice of dispatch and graph flags. Every plan is timed against the space's baseline
(``gain_over``: the whole-step-graph baseline on a GPU) in groups of ``--group`` plans plus the
baseline, interleaved in one process (the measurement rules of docs/design.md); its QPS gain
is the median over windows of the per-window p90-QPS ratio. NE depends only on which
candidates are detached (a placement changes no gradient, a stream no value), so NE is
measured once per detached set, trained as long as a trial trains, and every plan with that
set gets that NE gap. ``--shard i/n`` measures every n-th plan and set (one process per GPU);
``--merge FILE`` (repeated) joins shard files (each a ``DIR/replay_table*.json``) into
``DIR/replay_table.table.json``, the file ``sampler_efficiency --table`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.measure import provenance, ratio_spread, time_interleaved
from erase_tune.measure.confirm import baseline_plan
from erase_tune.measure.trial import Budget, Variant, build_engine, jsonable_args, release
from erase_tune.runtime import ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.workloads import get_workload, workload_args

REPLAY_SPACE = "search_spaces/ctr-replay.yaml"
"""The finite CTR space the shipped replay table covers."""
REPLAY_TABLE = "docs/results/h200-2026-12-01/replay_ctr.json"
"""The shipped replay table: every plan of :data:`REPLAY_SPACE` measured once on the H200."""


def detached(plan: ErasePlan) -> tuple[str, ...]:
    return tuple(sorted(c.module for c in plan.cuts))


def measure_qps(workload, plans: list[ErasePlan], base: ErasePlan, budget: Budget, group: int, device,
                save) -> list[dict]:
    torch.manual_seed(budget.seed)
    data = workload.make_data(device)
    init = workload.build_model().to(device)  # engines copy it on the device: no host round trip
    rows = []
    for start in range(0, len(plans), group):
        chunk = plans[start:start + group]
        runners: dict[str, Variant] = {}
        t0 = time.perf_counter()
        try:
            for name, p in {"baseline": base, **{str(i): p for i, p in enumerate(chunk)}}.items():
                runners[name] = Variant(plan=p, engine=build_engine(workload, p, init, data, device), data=data)
            timings = time_interleaved(runners, device=device, warmup_steps=budget.warmup_steps,
                                       windows=budget.windows, window_steps=budget.window_steps)
        finally:
            release(runners.values(), device)
            runners.clear()
        for i, p in enumerate(chunk):
            spread = ratio_spread(timings.variants[str(i)], timings.variants["baseline"], workload.batch_size,
                                  statistic="p90")
            rows.append({"plan": p.dumps(), "summary": p.describe(), "detached": list(detached(p)),
                         "qps_gain": spread.median - 1.0, "window_gains": [r - 1.0 for r in spread.per_window]})
        print(f"  plans {start}..{start + len(chunk) - 1}: {time.perf_counter() - t0:.1f}s", flush=True)
        save(rows)  # what is measured survives a time limit
    return rows


def measure_ne(workload, sets: list[tuple[str, ...]], base: ErasePlan, budget: Budget, device) -> dict[str, float]:
    """Held-out NE after a trial's worth of training, per detached set (the same weights and
    batches for each)."""
    from erase_tune.runtime import Cut

    torch.manual_seed(budget.seed)
    data = workload.make_data(device)
    init = workload.build_model().to(device)
    out = {}
    for s in sets:
        plan = dataclasses.replace(base, cuts=tuple(Cut(module=m) for m in s))
        engine = build_engine(workload, plan, init, data, device)
        try:
            for step in range(budget.training_steps):
                inputs, target = data.batch(step)
                engine.step(inputs, target)
            out["|".join(s)] = workload.normalized_entropy(engine.model, data)
        finally:
            release([Variant(plan=plan, engine=engine, data=data)], device)
        print(f"  NE {'|'.join(s) or 'no cuts'}: {out['|'.join(s)]:.4f}", flush=True)
    return out


@dataclasses.dataclass
class Options:
    space: str = opt(REPLAY_SPACE, "a finite search space")
    shard: str = opt("0/1", "i/n: measure every n-th plan and detached set, from the i-th")
    group: int = opt(16, "plans timed together with the baseline")
    device: str = opt("auto", "device (auto, cuda, cpu)")
    arg: list[str] = opt([], "override a workload argument KEY=VALUE")
    merge: list[str] = opt([], "a shard file to join (nothing is measured)")


def _table(doc: dict[str, Any]) -> dict[str, Any]:
    """A shard's or a merged file's table as the replay reads it (erase_tune.tune.search.replay)."""
    return doc.get("result", doc)


@case("replay_table", Options, cuda="optional", recorded_with="scripts/measure_replay_table.py",
      description="every plan of a finite space measured once (QPS gain; NE once per detached set), for replays",
      figures=(f"0.3 Tuner efficiency, by replay (the table {REPLAY_TABLE})",))
def replay_table(ns: Options, ctx: Context) -> dict[str, Any]:
    if ns.merge:
        parts = [_table(json.loads(Path(p).read_text())) for p in ns.merge]
        ne = {k: v for part in parts for k, v in part["ne"].items()}
        base_ne = ne[""]
        plans = [dict(r, ne_gap=(ne["|".join(r["detached"])] - base_ne) / base_ne) for part in parts for r in part["qps"]]
        merged = {"provenance": parts[0]["provenance"], "ne": ne, "plans": plans}
        ctx.path(".table.json").write_text(json.dumps(merged, indent=1))  # what ReplayTable.load reads
        return {**merged, "table": f"{ctx.path('.table.json')}: {len(plans)} plans, {len(ne)} detached sets "
                                   f"(merged from {len(parts)} files)"}
    from erase_tune.tune.search.checks import check_space
    from erase_tune.tune.search.replay import space_plans
    from erase_tune.tune.search.space import SearchSpace

    space = SearchSpace.load(ns.space)
    overrides = workload_args(ns.arg)
    if overrides:
        space = dataclasses.replace(space, workload=dataclasses.replace(space.workload,
                                                                        args={**space.workload.args, **overrides}))
    checked = check_space(space)
    plans = space_plans(checked)
    sets = sorted({detached(p) for p in plans}, key=lambda s: (len(s), s))
    index, count = (int(x) for x in ns.shard.split("/"))
    device = resolve_device(ns.device)
    workload = get_workload(space.workload.name, space.workload.args)
    base = baseline_plan(space.gain_over if device.type == "cuda" else "eager")
    print(f"{len(plans)} plans, {len(sets)} detached sets; shard {index}/{count} on {device}", flush=True)
    prov = provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                      budget=dataclasses.asdict(space.budget.per_trial), space=ns.space, gain_over=space.gain_over,
                      replay="every plan of the space measured once; NE once per detached set")
    ne: dict[str, float] = {}

    def save(qps: list[dict]) -> None:
        ctx.save({"provenance": prov, "qps": qps, "ne": ne})

    mine = sets[index::count]
    if () not in mine:  # every shard needs the baseline's NE to state gaps
        mine = [(), *mine]
    ne.update(measure_ne(workload, mine, base, space.budget.per_trial, device))
    qps = measure_qps(workload, plans[index::count], base, space.budget.per_trial, ns.group, device, save)
    return {"provenance": prov, "qps": qps, "ne": ne, "table": f"{len(qps)} plans, {len(ne)} NE sets"}
