"""Tuner efficiency by replay: hypervolume within the NE budget against measured trials, for
every sampler, over several seeds, on a table of plans measured on the GPU.

    python -m erase_tune.benchmarks sampler_efficiency --out DIR --table docs/results/h200-2026-12-01/replay_ctr.json \
        --space search_spaces/ctr-replay.yaml [--trials 60] [--seeds 3] [--png hv.png]

(recorded with scripts/sampler_efficiency.py, now this case; every run is in DIR/sampler_efficiency.json.)

Every number this prints is a REPLAY: the studies are real Optuna studies over the space,
but each proposed plan is answered from the table (erase_tune.tune.search.replay). The reference
point of the hypervolume is (QPS gain 0, NE gap = the space's budget). The default sampler
must reach, within 20 measured trials, the hypervolume random search has after 60.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.benchmarks.replay_table import REPLAY_SPACE, REPLAY_TABLE


@dataclasses.dataclass
class Options:
    table: str = opt(REPLAY_TABLE, "the replay table (measured on the GPU: replay_table)")
    space: str = opt(REPLAY_SPACE, "the space the table covers")
    trials: int = opt(60, "measured trials per study")
    seeds: int = opt(3, "studies per sampler")
    first_seed: int = opt(0, "seeds first-seed .. first-seed + seeds - 1")
    samplers: str = opt("", "samplers, comma separated; NAME+screen: the structural screen first, as start "
                            "does (default: every one, and front+screen)")
    png: str | None = opt(None, "plot the mean hypervolume (and its range over seeds) against trials")
    replot: str | None = opt(None, "only redraw --png from this earlier result JSON")


@case("sampler_efficiency", Options, recorded_with="scripts/sampler_efficiency.py",
      description="REPLAY: hypervolume within the NE budget against measured trials, per sampler, over seeds",
      figures=("0.3 Tuner efficiency, by replay (the table and the figure docs/results/h200-2026-12-01/sampler_efficiency.png)",))
def sampler_efficiency(ns: Options, ctx: Context) -> dict[str, Any]:
    from erase_tune.tune.search.checks import check_space
    from erase_tune.tune.search.replay import ReplayTable, replay_study
    from erase_tune.tune.search.space import SearchSpace
    from erase_tune.tune.search.study import SAMPLERS

    if ns.replot:
        done = json.loads(Path(ns.replot).read_text())
        plot(done.get("result", done), ns.png)
        return {"replot": ns.replot, "png": ns.png, "table": f"redrew {ns.png} from {ns.replot}"}
    samplers = ns.samplers or ",".join([*SAMPLERS, "front+screen"])
    table = ReplayTable.load(ns.table)
    space = SearchSpace.load(ns.space)
    checked = check_space(space)
    best = max((g for g, gap in table.points.values() if gap <= space.max_ne_gap), default=0.0)
    print(f"REPLAY of {len(table.points)} plans measured on {table.provenance.get('device_name')} "
          f"({table.provenance.get('date_utc')}); best gain within NE gap {space.max_ne_gap:.2%}: {best:+.2%}")
    runs = {name: [replay_study(checked, table, sampler=name.removesuffix("+screen"), seed=seed, trials=ns.trials,
                                screen=name.endswith("+screen"))
                   for seed in range(ns.first_seed, ns.first_seed + ns.seeds)]
            for name in samplers.split(",")}
    lines: list[str] = []
    marks = [k for k in (5, 10, 20, 30, 40, 60) if k <= ns.trials]
    lines.append(f"{'sampler':<12} " + " ".join(f"{'HV@' + str(k):>9}" for k in marks) + "   (mean over seeds)")

    def at(run, k: int) -> float:
        hv = run.hypervolume
        return hv[min(k, len(hv)) - 1] if hv else 0.0

    for name, rs in runs.items():
        lines.append(f"{name:<12} " + " ".join(f"{statistics.mean(at(r, k) for r in rs):>9.5f}" for k in marks))
    if "random" in runs:
        target = statistics.mean(at(r, ns.trials) for r in runs["random"])
        lines.append(f"random search's {ns.trials}-trial hypervolume, mean of {ns.seeds} seeds: {target:.7f}")
        for name, rs in runs.items():
            mean = [statistics.mean(at(r, k) for r in rs) for k in range(1, ns.trials + 1)]
            crossed = next((k + 1 for k, h in enumerate(mean) if h >= target), None)
            reached = [next((i + 1 for i, h in enumerate(r.hypervolume) if h >= target), None) for r in rs]
            within = sum(1 for k in reached if k is not None and k <= 20)
            median = statistics.median(k if k is not None else ns.trials + 1 for k in reached)
            lines.append(f"{name}: mean curve reaches it after {crossed} trials; per seed: median {median} "
                  f"(never: {ns.trials + 1}), within 20 trials on {within} of {len(rs)}")
    result = {
        "replay": True, "table_provenance": dict(table.provenance), "space": ns.space, "trials": ns.trials,
        "runs": {name: [{"seed": r.seed, "points": r.points, "hypervolume": r.hypervolume, "proposals": r.proposals}
                        for r in rs] for name, rs in runs.items()},
        "table": "\n".join(lines),
    }
    if ns.png:
        plot(result, ns.png)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, runs in result["runs"].items():
        n = max(len(r["hypervolume"]) for r in runs)
        series = [[r["hypervolume"][min(k, len(r["hypervolume"]) - 1)] for k in range(n)] for r in runs]
        mean = [statistics.mean(col) for col in zip(*series)]
        xs = range(1, n + 1)
        ax.plot(xs, mean, label=f"{name} (mean of {len(runs)} seeds)")
        ax.fill_between(xs, [min(c) for c in zip(*series)], [max(c) for c in zip(*series)], alpha=0.15)
    target = statistics.mean(r["hypervolume"][-1] for r in result["runs"]["random"]) if "random" in result["runs"] else None
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="random search after all trials")
        ax.axvline(20, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("measured trials")
    ax.set_ylabel("hypervolume within the NE budget")
    ax.set_title("REPLAY of H200 measurements: tuner efficiency on the CTR replay space", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
