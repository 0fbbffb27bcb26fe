"""A campaign variant of a shipped search space: the same file with the whole-step graph fixed
on, and the batch, NE budget and trial count changed; seeds that fall outside are dropped, and
plans exported by earlier studies (``--seed-plan``) can be added as seeds (a warm start).

    python -m erase_tune.benchmarks campaign_space --out DIR --src search_spaces/ctr.yaml \
        --dst DIR/ctr-8192.yaml --batch 8192 --max-ne-gap 0.01 --trials 16 [--seed-plan best.yaml ...]

(recorded with scripts/campaign_space.py, now this case: GPU campaign suites d, e, f, g.)
The result is checked by loading it as erase-tune would, so a changed shipped file fails here,
not on the GPU.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.runtime import ErasePlan
from erase_tune.workloads import workload_args


@dataclasses.dataclass
class Options:
    src: str = opt("search_spaces/ctr.yaml", "the shipped space to vary")
    dst: str = opt("", "the space file written (default DIR/campaign_space.yaml)")
    batch: int = opt(2048, "the workload's batch")
    max_ne_gap: float = opt(0.01, "the NE budget")
    trials: int = opt(24, "the study's trials")
    arg: list[str] = opt([], "another workload argument KEY=VALUE")
    seed_plan: list[str] = opt([], "an exported plan to seed with (FILE)")


@case("campaign_space", Options, recorded_with="scripts/campaign_space.py",
      description="a shipped space with the whole-step graph fixed on and the batch, NE budget, trials changed",
      figures=("0.1 The shipped product against the issue's table (the study's space, suites d, e, f)",
               "0.3.1 The default sampler on the H200 (suite g)"))
def campaign_space(a: Options, ctx: Context) -> dict[str, Any]:
    from erase_tune.tune.search.checks import check_space
    from erase_tune.tune.search.space import SearchSpace

    dst = a.dst or str(ctx.path(".yaml"))
    data = yaml.safe_load(Path(a.src).read_text())
    data["workload"]["args"]["batch"] = a.batch
    data["workload"]["args"].update(workload_args(a.arg))
    data["max_ne_gap"] = a.max_ne_gap
    data["trials"] = a.trials
    data["cuts"]["whole_step_graph"] = [True]
    data["seeds"] = [s for s in data.get("seeds", []) if s["plan"].get("whole_step_graph")]
    for f in a.seed_plan:
        plan = ErasePlan.load(f).to_dict()
        plan.pop("provenance", None)
        data["seeds"].append({"name": f"from-{Path(f).stem}", "plan": plan})
    Path(dst).write_text(yaml.safe_dump(data, sort_keys=False))
    space = SearchSpace.load(dst)
    checked = check_space(space)
    for seed in space.seeds:  # as start enqueues them: a seed outside the space fails here
        checked.params(seed.plan)
    seeds = [s.name for s in space.seeds]
    return {"space": dst, "batch": a.batch, "max_ne_gap": a.max_ne_gap, "trials": a.trials, "seeds": seeds,
            "table": f"{dst}: batch {a.batch}, budget {a.max_ne_gap:.1%}, {a.trials} trials, seeds {', '.join(seeds)}"}
