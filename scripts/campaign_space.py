"""A campaign variant of a shipped search space: the same file with the whole-step graph fixed
on, and the batch, NE budget and trial count changed; seeds that fall outside are dropped.

    python scripts/campaign_space.py search_spaces/ctr.yaml out/ctr-8192.yaml --batch 8192 --max-ne-gap 0.01

The result is checked by loading it as erase-tune would, so a changed shipped file fails here,
not on the GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from erase_tune.tune.space import SearchSpace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--max-ne-gap", type=float, required=True)
    ap.add_argument("--trials", type=int, required=True)
    a = ap.parse_args()
    data = yaml.safe_load(Path(a.src).read_text())
    data["workload"]["args"]["batch"] = a.batch
    data["max_ne_gap"] = a.max_ne_gap
    data["trials"] = a.trials
    data["cuts"]["whole_step_graph"] = [True]
    data["seeds"] = [s for s in data.get("seeds", []) if s["plan"].get("whole_step_graph")]
    Path(a.dst).write_text(yaml.safe_dump(data, sort_keys=False))
    space = SearchSpace.load(a.dst)
    print(f"{a.dst}: batch {a.batch}, budget {a.max_ne_gap:.1%}, {a.trials} trials, "
          f"seeds {', '.join(n for n, _ in space.seeds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
