"""Does the shipped short trial budget rank plans as a 4x longer one does? Kendall's tau.

    python -m erase_tune.benchmarks rank_agreement --out DIR --space search_spaces/ctr.yaml --plans 12 \
        --scale 4 [--arg train_batches=1700]

(recorded with scripts/budget_rank_agreement.py, now this case.)

Twelve distinct plans of the space (its seeds, then plans a seeded random sampler proposes)
are each measured twice, in one process on one device: with the space's budget and with
its timing windows and quality steps multiplied by ``--scale``. For the QPS gain (over the
space's baseline) and the NE gap, Kendall's tau-b between the two rankings says whether
the short budget picks the same plans a long one would. Give the workload enough training
batches for the long run to read each batch once (``--arg train_batches=...``): a second
pass over-fits a CTR model and would skew the long run's NE.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any


from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.measure.trial import Budget, run_trial
from erase_tune.runtime import ErasePlan
from erase_tune.workloads import get_workload, workload_args

if TYPE_CHECKING:
    from erase_tune.tune.search.space import SearchSpace


def kendall_tau_b(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties handled as in tau-b)."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    denom = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denom if denom else 0.0


def pick_plans(space: SearchSpace, n: int) -> list[ErasePlan]:
    import optuna

    from erase_tune.tune.search.checks import check_space

    checked = check_space(space)
    plans = {s.plan.canonical().dumps(): s.plan.canonical() for s in space.seeds}
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(50 * n):
        if len(plans) >= n:
            break
        trial = study.ask()
        plan = checked.plan(trial)
        plans.setdefault(plan.dumps(), plan)
        study.tell(trial, [0.0, 0.0])
    return list(plans.values())[:n]


@dataclasses.dataclass
class Options:
    space: str = opt("search_spaces/ctr.yaml", "the search space whose plans are ranked")
    plans: int = opt(12, "distinct plans: the space's seeds, then a seeded random sampler's")
    scale: int = opt(4, "the long budget's windows and quality steps over the space's")
    device: str = opt("auto", "device (auto, cuda, cpu)")
    arg: list[str] = opt([], "a workload argument KEY=VALUE")
    first: int = opt(0, "start at this plan (to finish a run cut short)")


@case("rank_agreement", Options, cuda="optional", recorded_with="scripts/budget_rank_agreement.py",
      description="Kendall's tau between a short trial budget's ranking of plans and a 4x longer one's",
      figures=("0.5 Does the short budget rank plans as a 4x longer one?",))
def rank_agreement(ns: Options, ctx: Context) -> dict[str, Any]:
    import optuna

    from erase_tune.tune.search.space import SearchSpace

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = SearchSpace.load(ns.space)
    args = {**space.workload.args, **workload_args(ns.arg)}
    space = dataclasses.replace(space, workload=dataclasses.replace(space.workload, args=args))
    workload = get_workload(space.workload.name, args)
    short = space.budget.per_trial
    long = dataclasses.replace(short, windows=short.windows * ns.scale, quality_steps=short.quality_steps * ns.scale)
    gain_key = "gain_vs_reference" if space.gain_over == "graph" else "gain_p90"
    rows = []
    baseline_ne: dict[str, float] = {}  # the baseline trains once per budget, as the service's cache does
    for i, plan in enumerate(pick_plans(space, ns.plans)):
        if i < ns.first:
            continue
        row = {"plan": plan.describe()}
        for label, budget in (("short", short), ("long", long)):
            r = run_trial(workload, plan, Budget(**dataclasses.asdict(budget)), device=ns.device,
                          baseline_ne=baseline_ne.get(label))
            baseline_ne.setdefault(label, r.ne_baseline)
            row[label] = {"qps_gain": getattr(r, gain_key), "ne_gap": r.ne_gap, "seconds": r.duration_s}
        rows.append(row)
        ctx.save({"rows": rows})  # survives a time limit
        print(f"{i:>2} {row['short']['qps_gain']:+.2%} / {row['long']['qps_gain']:+.2%}  "
              f"NE {row['short']['ne_gap']:+.2%} / {row['long']['ne_gap']:+.2%}  {plan.describe()}", flush=True)
    taus = {k: kendall_tau_b([r["short"][k] for r in rows], [r["long"][k] for r in rows]) for k in ("qps_gain", "ne_gap")}
    table = (f"Kendall tau-b, short vs {ns.scale}x budget, {len(rows)} plans: QPS gain {taus['qps_gain']:+.3f}, "
             f"NE gap {taus['ne_gap']:+.3f}")
    return {"space": ns.space, "workload_args": args, "scale": ns.scale, "short_budget": dataclasses.asdict(short),
            "long_budget": dataclasses.asdict(long), "rows": rows, "kendall_tau": taus, "table": table}
