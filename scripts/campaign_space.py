"""A campaign variant of a shipped search space: the same file with the whole-step graph fixed
on, and the batch, NE budget and trial count changed; seeds that fall outside are dropped, and
plans exported by earlier studies (``--seed-plan``) can be added as seeds (a warm start).

    python scripts/campaign_space.py search_spaces/ctr.yaml out/ctr-8192.yaml --batch 8192 --max-ne-gap 0.01 \
        --trials 16 [--seed-plan best.yaml ...]

The result is checked by loading it as erase-tune would, so a changed shipped file fails here,
not on the GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from erase_tune.runtime import ErasePlan  # noqa: E402
from erase_tune.tune.search.checks import check_space  # noqa: E402
from erase_tune.tune.search.space import SearchSpace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--max-ne-gap", type=float, required=True)
    ap.add_argument("--trials", type=int, required=True)
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="another workload argument")
    ap.add_argument("--seed-plan", action="append", default=[], metavar="FILE", help="an exported plan to seed with")
    a = ap.parse_args()
    data = yaml.safe_load(Path(a.src).read_text())
    data["workload"]["args"]["batch"] = a.batch
    for kv in a.arg:
        key, _, value = kv.partition("=")
        data["workload"]["args"][key] = yaml.safe_load(value)
    data["max_ne_gap"] = a.max_ne_gap
    data["trials"] = a.trials
    data["cuts"]["whole_step_graph"] = [True]
    data["seeds"] = [s for s in data.get("seeds", []) if s["plan"].get("whole_step_graph")]
    for f in a.seed_plan:
        plan = ErasePlan.load(f).to_dict()
        plan.pop("provenance", None)
        data["seeds"].append({"name": f"from-{Path(f).stem}", "plan": plan})
    Path(a.dst).write_text(yaml.safe_dump(data, sort_keys=False))
    space = SearchSpace.load(a.dst)
    checked = check_space(space)
    for _, plan in space.seeds:  # as start enqueues them: a seed outside the space fails here
        checked.params(plan)
    print(f"{a.dst}: batch {a.batch}, budget {a.max_ne_gap:.1%}, {a.trials} trials, "
          f"seeds {', '.join(n for n, _ in space.seeds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
