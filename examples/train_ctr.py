"""Production-style CTR training with an exported ERASE plan.

    python examples/train_ctr.py --plan best.yaml [--steps 500] [--device cuda] [--arg batch=8192 ...]
    torchrun --standalone --nproc_per_node 2 examples/train_ctr.py --ddp --plan best.yaml [...]

The plan file is what ``erase-tune export`` writes. Training code does not change with the
plan: build the model and optimizer as usual, wrap them in ``EraseEngine``, call
``engine.step``. Workload arguments default to the ones the plan was tuned on (its
provenance), so the model the plan names is the model being trained.

``--ddp`` (under torchrun): data-parallel training. The process group comes from the
variables torchrun sets (gloo on the CPU, nccl on CUDA, one GPU per local rank); each rank
trains on its equal share of every batch (``batch`` is the global batch) and passes
``process_group=`` to ``EraseEngine``, which averages the gradients itself (the bare module,
never a DistributedDataParallel wrapper). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
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
    parser.add_argument("--ddp", action="store_true", help="data parallel, under torchrun")
    ns = parser.parse_args(argv)
    rank, world, group = 0, 1, None
    try:
        plan = ErasePlan.load(ns.plan)
        args = dict(plan.provenance.get("workload_args") or {})
        for pair in ns.arg:
            key, _, value = pair.partition("=")
            args[key] = yaml.safe_load(value)
        workload = get_workload(plan.provenance.get("workload") or "ctr", args)
        device = resolve_device(ns.device)
        if ns.ddp:
            rank, world, group, device = _init_distributed(device)
        torch.manual_seed(0)
        data = workload.make_data(device)
        if workload.batch_size % world:
            raise EraseTuneError(f"--ddp: batch {workload.batch_size} does not split into {world} equal shares")
        shard = _sharder(rank, world)
        model = workload.build_model().to(device)
        engine = EraseEngine(model, plan, loss_fn=workload.loss_fn, optimizer=workload.optimizer,
                             example=shard(data.batch(0)), make_head=workload.make_head, process_group=group)
    except EraseTuneError as e:
        print(f"train_ctr: error: {e}", file=sys.stderr)
        return 2
    log = print if rank == 0 else (lambda *a, **k: None)
    code = _train(ns, plan, workload, data, model, engine, device, shard, log, world)
    if group is not None:
        dist.destroy_process_group()
    return code


def _init_distributed(device: torch.device) -> tuple[int, int, object, torch.device]:
    """The process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise EraseTuneError("--ddp: RANK and WORLD_SIZE are not set; start this script with torchrun")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device


def _sharder(rank: int, world: int):
    """This rank's equal share of a batch (every tensor split along its first dim)."""
    def shard(batch):
        inputs, target = batch
        n = len(target) // world
        return tuple(x[rank * n:(rank + 1) * n] for x in inputs), target[rank * n:(rank + 1) * n]
    return shard


def _train(ns, plan, workload, data, model, engine, device, shard, log, world: int) -> int:
    log(f"training {workload.name} with plan: {plan.describe()}"
          + (f"; data parallel over {world} ranks" if world > 1 else ""))
    if plan.provenance:
        p = plan.provenance
        confirmed = (f"confirmed {p['confirmed_gain']:+.2%} [{p['confirmed_gain_lo']:+.2%}, {p['confirmed_gain_hi']:+.2%}]"
                     if "confirmed_gain" in p else "not re-measured")
        log(f"  tuned in study {p.get('study')} trial {p.get('trial')}: QPS gain {p.get('search_qps_gain', 0):+.2%} "
              f"over the {p.get('gain_over')} baseline ({confirmed}), NE gap {p.get('search_ne_gap', 0):+.2%}")
    ne0 = workload.normalized_entropy(model, data)
    start = time.perf_counter()
    for step in range(ns.steps):
        inputs, target = shard(data.batch(step))
        loss = engine.step(inputs, target)
        if (step + 1) % max(1, ns.steps // 5) == 0:
            log(f"  step {step + 1:>5}  loss {float(loss):.4f}" + (" (rank 0's share)" if world > 1 else ""))
    synchronize(device)
    elapsed = time.perf_counter() - start
    ne = workload.normalized_entropy(model, data)
    # examples/s counts every rank's share: the global batch per step
    log(f"held-out NE {ne0:.4f} -> {ne:.4f}; {ns.steps * workload.batch_size / elapsed:,.0f} examples/s")
    engine.close()
    return 0 if ne < ne0 else 1


if __name__ == "__main__":
    sys.exit(main())
