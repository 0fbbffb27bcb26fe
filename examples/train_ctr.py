"""Production-style CTR training with an exported ERASE plan.

    python examples/train_ctr.py --plan best.yaml [--steps 500] [--device cuda] [--arg batch=8192 ...]

The plan file is what ``erase-tune export`` writes. Training code does not change with the
plan: build the model and optimizer as usual, wrap them in ``EraseEngine``, call
``engine.step``. Workload arguments default to the ones the plan was tuned on (its
provenance), so the model the plan names is the model being trained.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import yaml

from erase_tune import EraseEngine, ErasePlan, EraseTuneError
from erase_tune.runtime.device import resolve_device, synchronize
from erase_tune.workloads import get_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    ns = parser.parse_args(argv)
    try:
        plan = ErasePlan.load(ns.plan)
        tuned = (plan.provenance.get("workload") or {}) if isinstance(plan.provenance.get("workload"), dict) else {}
        args = dict(tuned.get("args") or {})
        for pair in ns.arg:
            key, _, value = pair.partition("=")
            args[key] = yaml.safe_load(value)
        workload = get_workload(tuned.get("name", "ctr"), args)
        device = resolve_device(ns.device)
        torch.manual_seed(0)
        data = workload.make_data(device)
        model = workload.build_model().to(device)
        engine = EraseEngine(model, plan, loss_fn=workload.loss_fn, optimizer=workload.optimizer,
                             example=data.batch(0), make_head=workload.make_head)
    except EraseTuneError as e:
        print(f"train_ctr: error: {e}", file=sys.stderr)
        return 2
    print(f"training {workload.name} with plan: {plan.describe()}")
    if plan.provenance:
        p = plan.provenance
        print(f"  tuned in study {p.get('study')} trial {p.get('trial')}: QPS gain {p.get('qps_gain')} over the "
              f"{p.get('gain_over')} baseline, NE gap {p.get('ne_gap')}")
    ne0 = workload.normalized_entropy(model, data)
    start = time.perf_counter()
    for step in range(ns.steps):
        inputs, target = data.batch(step)
        loss = engine.step(inputs, target)
        if (step + 1) % max(1, ns.steps // 5) == 0:
            print(f"  step {step + 1:>5}  loss {float(loss):.4f}")
    synchronize(device)
    elapsed = time.perf_counter() - start
    ne = workload.normalized_entropy(model, data)
    print(f"held-out NE {ne0:.4f} -> {ne:.4f}; {ns.steps * workload.batch_size / elapsed:,.0f} examples/s")
    engine.close()
    return 0 if ne < ne0 else 1


if __name__ == "__main__":
    sys.exit(main())
