"""GPU evidence for the NE gap (issue 17): the noise floor of each shipped space, and whether the
search's short NE gap ranks plans as the confirmed (longer, several seeds) one does.

    python -m erase_tune.benchmarks ne_evidence --out "$OUT" [--repeats 3] [--rank-plans 12] [--scale 4]
        [--seeds 2] [--spaces ctr,gpt-bf16,gpt-fp32,mlp,dlrm] [--steps-factor 1.0] [--rank-steps-factor 0.5]
        [--time-limit 300] [--overrun 150] [--rank-arg train_batches=1700] [--smoke]
    (or: python -m erase_tune.benchmarks --suite n --out "$OUT")

(recorded with scripts/ne_evidence.py, now this case.)

Part 1, the noise floor (erase_tune.measure.noise.measure_noise_floor): for each shipped space, the
baseline trained against itself for the space's trial training steps under perturbations that
cannot matter (``--repeats`` other data orders, and the whole-step CUDA graph), at the space's
workload arguments; gpt twice, with bf16 and with float32 compute; dlrm when the workload
exists. Part 2, rank agreement on ``--rank-space`` (default ctr): ``--rank-plans`` distinct plans
of the space (its seeds, then a seeded random sampler's), each plan's NE gap as the search
measures it (one training of the trial's length, the trial's data order) and as quality
confirmation does (``--scale`` times longer, ``--seeds`` data orders, with a 95% interval);
Kendall's tau-b between the two, and every plan the short gap misjudges against the budget
(beyond the noise) next to whether the confirmation catches it.

Everything is one process on one device; the table goes to stdout and everything measured, with
provenance, to ``$OUT/ne_evidence.json`` (written after each measurement, so a run cut short
keeps what it measured). ``--time-limit`` skips what would start after that many seconds and
the longer confirmation is shrunk (fewer orders, then a smaller scale) to end within
``--overrun`` more, so the whole run stays under 8 minutes on one H200; ``--steps-factor``
scales every training, ``--rank-steps-factor`` the rank agreement's further.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any


from erase_tune.benchmarks.case import ROOT, Context, case, opt
from erase_tune.measure.noise import QualitySettings, confirm_quality, exact_by_construction, feasible, measure_noise_floor
from erase_tune.measure.trial import Budget
from erase_tune.workloads import BUILTINS, get_workload, workload_args

if TYPE_CHECKING:
    from erase_tune.tune.search.space import SearchSpace

SPACES = {  # name: (space file, workload-argument overrides)
    "ctr": ("ctr.yaml", {}),
    "gpt-bf16": ("gpt.yaml", {"dtype": "bfloat16"}),
    "gpt-fp32": ("gpt.yaml", {"dtype": "float32"}),
    "mlp": ("mlp.yaml", {}),
    "dlrm": ("dlrm.yaml", {}),
}


def _file(file: str, smoke: bool) -> str:
    """``--smoke``: the space's small CPU variant (``ctr-smoke.yaml``), to try the script anywhere."""
    return file.replace(".yaml", "-smoke.yaml") if smoke else file


def _budget(space: SearchSpace, factor: float) -> Budget:
    b = space.budget.per_trial
    quality = max(0, round((b.training_steps * factor) - b.warmup_steps - b.windows * b.window_steps))
    return dataclasses.replace(b, quality_steps=quality)


def noise_floors(ns: Options, record: dict[str, Any], ctx: Context, started: float) -> None:
    from erase_tune.tune.search.space import SearchSpace

    print(f"{'space':<10} {'steps':>6} {'band':>8}  gaps (kind)", flush=True)
    for name in [s for s in ns.spaces.split(",") if s]:
        if time.monotonic() - started > ns.time_limit:
            record["noise_floor"][name] = {"skipped": "time limit"}
            print(f"{name:<10} skipped: time limit", flush=True)
            continue
        file, overrides = SPACES[name]
        path = ROOT / "search_spaces" / _file(file, ns.smoke)
        if name == "dlrm" and ("dlrm" not in BUILTINS or not path.exists()):
            record["noise_floor"][name] = {"skipped": "no dlrm workload or space in this tree"}
            print(f"{name:<10} skipped: no dlrm workload", flush=True)
            continue
        space = SearchSpace.load(path)
        args = {**space.workload.args, **overrides}
        try:
            workload = get_workload(space.workload.name, args)
            t0 = time.monotonic()
            floor = measure_noise_floor(workload, _budget(space, ns.steps_factor), repeats=ns.repeats,
                                        device=ns.device)
        except Exception as e:  # noqa: BLE001 - one space failing must not lose the others
            record["noise_floor"][name] = {"failed": f"{type(e).__name__}: {e}"}
            print(f"{name:<10} FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        record["noise_floor"][name] = {**floor.to_dict(), "workload_args": {k: str(v) for k, v in args.items()},
                                       "seconds": round(time.monotonic() - t0, 1)}
        gaps = ", ".join(f"{g:+.3%} ({k})" for g, k in zip(floor.gaps, floor.kinds))
        print(f"{name:<10} {floor.training_steps:>6} {floor.band:>8.3%}  {gaps}", flush=True)
        ctx.save(record)


def _fit_in_time(short_s: float, left: float, scale: int, seeds: int) -> tuple[int, int]:
    """The confirmation's scale and seeds, fewer seeds first, then a smaller scale (neither below
    2), until about ``short_s x scale x seeds`` fits in ``left`` seconds (or neither can shrink)."""
    while short_s * scale * seeds > left and (seeds > 2 or scale > 2):
        if seeds > 2:
            seeds -= 1
        else:
            scale -= 1
    return scale, seeds


def _misjudged(rows: dict[str, dict[str, Any]], max_ne_gap: float, band: float) -> list[dict[str, Any]]:
    """The plans whose search gap and confirmed gap disagree on feasibility against the budget."""
    misjudged = []
    for n, r in rows.items():
        said = feasible(r["search_ne_gap"], max_ne_gap, band)
        truth = feasible(r["confirmed_ne_gap"], max_ne_gap, band)
        if said != truth:
            misjudged.append({"plan": n, "search_feasible": said, "confirmed_feasible": truth,
                              "caught_by_confirmation": said and not truth})
    return misjudged


def rank_agreement(ns: Options, record: dict[str, Any], ctx: Context, started: float) -> None:
    from erase_tune.benchmarks.rank_agreement import kendall_tau_b, pick_plans
    from erase_tune.tune.search.space import SearchSpace

    file, overrides = SPACES[ns.rank_space]
    space = SearchSpace.load(ROOT / "search_spaces" / _file(file, ns.smoke))
    extra = workload_args(ns.rank_arg)
    args = {**space.workload.args, **overrides, **extra}
    space = dataclasses.replace(space, workload=dataclasses.replace(space.workload, args=args))
    workload = get_workload(space.workload.name, space.workload.args)
    budget = _budget(space, ns.steps_factor * ns.rank_steps_factor)
    plans = {str(i): p for i, p in enumerate(pick_plans(space, ns.rank_plans))}
    band = record["noise_floor"].get(ns.rank_space, {}).get("band", 0.0) or 0.0
    rows: dict[str, dict[str, Any]] = {}
    # The search's gap: one training of the trial's length, in the trial's order (scale 1, seed 1).
    if time.monotonic() - started > ns.time_limit:
        record["rank"] = {"skipped": "time limit"}
        return
    short = confirm_quality(workload, plans, budget=budget, settings=QualitySettings(scale=1, seeds=1, band=band),
                            device=ns.device)
    for name, p in plans.items():
        rows[name] = {"plan": p.describe(), "exact": exact_by_construction(p), "search_ne_gap": short.plans[name].ne_gap}
    record["rank"] = {"space": ns.rank_space, "max_ne_gap": space.max_ne_gap, "band": band, "plans": rows,
                      "search_steps": short.steps, "provenance": dict(short.provenance)}
    ctx.save(record)
    # The longer run costs about scale x seeds times the short one: fit it in what is left.
    short_s = float(short.provenance.get("duration_s") or 0.0)
    left = ns.time_limit + ns.overrun - (time.monotonic() - started)
    scale, seeds = _fit_in_time(short_s, left, ns.scale, ns.seeds)
    if short_s * scale * seeds > left:
        record["rank"]["confirmed"] = f"skipped: needs about {short_s * scale * seeds:.0f}s, {left:.0f}s left"
        print(f"rank agreement: {record['rank']['confirmed']}", flush=True)
        ctx.save(record)
        return
    if (scale, seeds) != (ns.scale, ns.seeds):
        print(f"rank agreement: confirming at scale {scale} over {seeds} orders to fit the time left", flush=True)
    ns.scale, ns.seeds = scale, seeds
    long = confirm_quality(workload, plans, budget=budget,
                           settings=QualitySettings(scale=ns.scale, seeds=ns.seeds, band=band), device=ns.device)
    for name, c in long.plans.items():
        rows[name].update({"confirmed_ne_gap": c.ne_gap, "lo": c.lo, "hi": c.hi, "per_seed": list(c.per_seed)})
    cut = [n for n in rows if not rows[n]["exact"]]
    a = [rows[n]["search_ne_gap"] for n in cut]
    b = [rows[n]["confirmed_ne_gap"] for n in cut]
    tau = kendall_tau_b(a, b) if len(cut) >= 2 else math.nan
    misjudged = _misjudged({n: rows[n] for n in cut}, space.max_ne_gap, band)
    record["rank"].update({"confirmed_steps": long.steps, "seeds": ns.seeds, "kendall_tau_b": tau,
                           "plans_with_cuts": len(cut), "misjudged": misjudged,
                           "confirmed_provenance": dict(long.provenance)})
    ctx.save(record)
    print(f"\nrank agreement on {ns.rank_space}: search ({short.steps} steps, trial order) against confirmed "
          f"({long.steps} steps x {ns.seeds} orders), budget {space.max_ne_gap:.2%} + noise {band:.3%}")
    print(f"{'plan':>4} {'search gap':>11} {'confirmed gap':>14} {'95% interval':>22}  plan")
    for n, r in rows.items():
        interval = f"[{r['lo']:+.3%}, {r['hi']:+.3%}]"
        print(f"{n:>4} {r['search_ne_gap']:>+11.3%} {r['confirmed_ne_gap']:>+14.3%} {interval:>22}  "
              f"{'(exact) ' if r['exact'] else ''}{r['plan'][:70]}")
    print(f"Kendall tau-b over the {len(cut)} plans with cuts: {tau:.3f}; misjudged against the budget: "
          f"{len(misjudged)} (all caught by the confirmation: {all(m['caught_by_confirmation'] for m in misjudged)})")


@dataclasses.dataclass
class Options:
    device: str = opt("auto", "device (auto, cuda, cpu)")
    spaces: str = opt("ctr,gpt-bf16,gpt-fp32,mlp,dlrm", "the noise floors to measure, comma separated")
    repeats: int = opt(3, "data orders per noise floor")
    rank_space: str = opt("ctr", "the space of the rank agreement", choices=tuple(sorted(SPACES)))
    rank_plans: int = opt(12, "plans of the rank agreement")
    rank_arg: list[str] = opt([], "workload argument for the rank agreement KEY=VALUE (e.g. train_batches=1700: "
                              "the longer training reads each batch once; a second pass over-fits a CTR model)")
    scale: int = opt(4, "confirmed training length / the trial's")
    seeds: int = opt(2, "data orders of the confirmation")
    steps_factor: float = opt(1.0, "scale every training length")
    rank_steps_factor: float = opt(0.5, "scale the rank agreement's trainings further (0.5: 12 plans x 4 x 2 fit "
                                   "the time)")
    time_limit: float = opt(300.0, "start nothing new after this many seconds")
    overrun: float = opt(150.0, "seconds the last step may run past --time-limit (150: 7.5 minutes in all)")
    skip_rank: bool = opt(False, "the noise floors only")
    smoke: bool = opt(False, "the *-smoke.yaml spaces (a dry run on a CPU)")


@case("ne_evidence", Options, cuda="optional", recorded_with="scripts/ne_evidence.py",
      description="the NE gap's noise floor per shipped space, and the rank agreement of search and confirmed NE gaps",
      figures=("00.2b The noise floor of the NE gap", "00.4 NE rank agreement (issue 17)",
               "00.5 After the engine split (mlp's noise floor)"))
def ne_evidence(ns: Options, ctx: Context) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.monotonic()
    record: dict[str, Any] = {"args": dataclasses.asdict(ns), "noise_floor": {}}
    noise_floors(ns, record, ctx, started)
    if not ns.skip_rank:
        rank_agreement(ns, record, ctx, started)
    record["seconds"] = round(time.monotonic() - started, 1)
    record["table"] = "\n".join(
        f"{name:<10} " + (f"{f['training_steps']:>6} {f['band']:>8.3%}" if "band" in f else next(iter(f.values())))
        for name, f in record["noise_floor"].items())
    return record
