"""One rank of the data-parallel tests (tests/runtime/test_ddp.py starts two, gloo on the CPU).

    python -m tests.runtime.ddp_worker RANK WORLD INIT_FILE OUT_DIR [cuda]

Runs every case in one process group and saves what the test compares to ``OUT_DIR/rankN.pt``:
per case, each parameter's gradient after the last step and its value after it, the losses,
and the error messages of the refusals. The single-process reference lives in the test.
With ``cuda`` (tests/runtime/test_ddp_gpu.py): NCCL, one GPU per rank, float32, every
dispatch and graph mode; per mode the model and heads before the last step and the grads after.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from erase_tune import Cut, EraseEngine, ErasePlan, EraseTuneError, Placement
from erase_tune.runtime import pieces as pieces_module
from tests.runtime.models import Toy, loss_fn, toy_batch

CUTS = (
    Cut(module="towers.0", stream=1, aux_weight=0.5),
    Cut(module="towers.2", stream=2, aux_weight=2.0),
    Cut(module="blocks.0:2", stream=1),
)
PLACEMENTS = (Placement(module="towers.1", stream=2),)
GLOBAL_BATCH = 32
STEPS = 2
sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def plans() -> dict[str, ErasePlan]:
    """The cases: every dispatch mode with find_unused_parameters off and on, and a graph flag."""
    out = {}
    for dispatch in ("blocking", "threaded", "deferred"):
        for fup in (False, True):
            out[f"{dispatch}-fup-{'on' if fup else 'off'}"] = ErasePlan(
                cuts=CUTS, placements=PLACEMENTS, num_streams=2, dispatch=dispatch, find_unused_parameters=fup)
    # whole_step_graph is a CUDA feature: on the CPU the engine runs the step eagerly
    out["blocking-fup-off-whole-step-graph"] = ErasePlan(cuts=CUTS, placements=PLACEMENTS, num_streams=2,
                                                         whole_step_graph=True)
    return out


def batch(step: int, rank: int | None = None, world: int = 2):
    """The global batch of ``step``, or rank ``rank``'s equal share of it."""
    (x,), y = toy_batch(n=GLOBAL_BATCH, seed=step, dtype=torch.float64)
    if rank is None:
        return (x,), y
    n = GLOBAL_BATCH // world
    return (x[rank * n:(rank + 1) * n],), y[rank * n:(rank + 1) * n]


def snapshot(engine: EraseEngine, losses: list[float]) -> dict:
    grads, params = {}, {}
    for name, p in engine._named_parameters():
        grads[name] = None if p.grad is None else p.grad.detach().clone()
        params[name] = p.detach().clone()
    return {"grads": grads, "params": params, "losses": losses}


def train(plan: ErasePlan, rank: int | None, world: int, group, model_seed: int = 0,
          pool: ThreadPoolExecutor | None = None) -> dict:
    torch.manual_seed(model_seed)  # rank 1 starts from other weights: the broadcast must fix that
    model = Toy().double()
    engine = EraseEngine(model, plan, loss_fn=loss_fn, optimizer=sgd, example=batch(0, rank, world),
                         process_group=group)
    if pool is not None:
        engine._launcher._pool = pool
    losses = [float(engine.step(*batch(step, rank, world))) for step in range(STEPS)]
    out = snapshot(engine, losses)
    engine.close()
    return out


def completion_order_case(rank: int, world: int) -> dict:
    """Threaded dispatch with two workers whose backwards finish in a different order on each rank."""
    order: list[int] = []
    calls = {"n": 0}
    lock = threading.Lock()
    slow = {0: 2, 1: 0}[rank]  # rank 0 delays its third cut's backward, rank 1 its first
    real = pieces_module._backward_on

    def backward_on(aux, stream):
        with lock:
            k = calls["n"] % len(CUTS)
            calls["n"] += 1
        if k == slow:
            time.sleep(0.3)
        real(aux, stream)
        with lock:
            order.append(k)

    pieces_module._backward_on = backward_on
    try:
        plan = ErasePlan(cuts=CUTS, placements=PLACEMENTS, num_streams=2, dispatch="threaded")
        out = train(plan, rank, world, dist.group.WORLD, pool=ThreadPoolExecutor(2))
    finally:
        pieces_module._backward_on = real
    out["completion_order"] = order
    return out


def mixed_order_sums(rank: int) -> dict:
    """What goes wrong without the order rule: two same-sized gradients all-reduced in completion
    order (which differs between ranks) are summed with each other's counterparts."""
    torch.manual_seed(0)
    model = Toy().double()
    engine = EraseEngine(model, ErasePlan(cuts=CUTS[:2], num_streams=2), loss_fn=loss_fn, optimizer=sgd, example=batch(0, rank))
    engine.forward_backward(*batch(0, rank))
    grads = {name: torch.cat([p.grad.flatten() for p in getattr(model.towers, name[-1]).parameters()])
             for name in ("towers.0", "towers.2")}
    true_mean = {}
    for name, g in grads.items():
        parts = [torch.empty_like(g) for _ in range(2)]
        dist.all_gather(parts, g)
        true_mean[name] = (parts[0] + parts[1]) / 2
    order = ["towers.0", "towers.2"] if rank == 0 else ["towers.2", "towers.0"]
    reduced = {name: grads[name].clone() for name in grads}
    for name in order:  # issued as each backward completed
        dist.all_reduce(reduced[name])
        reduced[name] /= 2
    engine.close()
    return {name: bool(torch.allclose(reduced[name], true_mean[name])) for name in grads}


def refusals(rank: int) -> dict:
    out = {}
    toy = Toy()
    ddp = nn.parallel.DistributedDataParallel(toy)
    try:
        EraseEngine(ddp, ErasePlan(), loss_fn=loss_fn, process_group=dist.group.WORLD)
    except EraseTuneError as e:
        out["ddp"] = str(e)

    class Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)

        def forward(self, x):
            return self.emb(x).sum(-1)

    try:
        EraseEngine(Sparse(), ErasePlan(), loss_fn=loss_fn, process_group=dist.group.WORLD)
    except EraseTuneError as e:
        out["sparse"] = str(e)

    class SharedBias(Toy):  # uses a parameter of towers.0 outside the cut
        def forward(self, x):
            return super().forward(x) + self.towers[0][2].bias.sum()

    for fup in (False, True):
        torch.manual_seed(0)
        plan = ErasePlan(cuts=CUTS, num_streams=2, find_unused_parameters=fup)
        engine = EraseEngine(SharedBias().double(), plan, loss_fn=loss_fn, optimizer=sgd, example=batch(0, rank),
                             process_group=dist.group.WORLD)
        try:
            engine.step(*batch(0, rank))
            out[f"shared-fup-{fup}"] = "ok"
        except EraseTuneError as e:
            out[f"shared-fup-{fup}"] = str(e)
        engine.close()
    return out


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    results: dict = {"cases": {}}
    for name, plan in plans().items():
        results["cases"][name] = train(plan, rank, world, dist.group.WORLD, model_seed=rank)
    # torch.distributed is initialised, but no process_group: the engine stays single-process
    results["no_group"] = train(plans()["blocking-fup-off"], rank, world, None)
    results["completion_order"] = completion_order_case(rank, world)
    results["mixed_order"] = mixed_order_sums(rank)
    results["refusals"] = refusals(rank)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


GPU_MODES = {
    "blocking": {"dispatch": "blocking"},
    "threaded": {"dispatch": "threaded"},
    "deferred": {"dispatch": "deferred"},
    "per-cut-graphs": {"dispatch": "threaded", "graph": True},
    "whole-step-graph": {"dispatch": "blocking", "whole_step_graph": True},
    "whole-step-graph-deferred": {"dispatch": "deferred", "whole_step_graph": True},
}
GPU_BATCH = 512
GPU_STEPS = 6  # past warm-up and capture: the checked step is a graph replay where graphs are on


def gpu_plan(mode: str, fup: bool) -> ErasePlan:
    kw = dict(GPU_MODES[mode])
    graph = kw.pop("graph", False)
    cuts = (
        Cut(module="towers.0", stream=1, aux_weight=0.5, graph=graph),
        Cut(module="towers.2", stream=2, aux_weight=2.0, graph=graph),
        Cut(module="blocks.0:2", stream=1, graph=graph),
    )
    return ErasePlan(cuts=cuts, placements=(Placement(module="towers.1", stream=2),), num_streams=2,
                     find_unused_parameters=fup, **kw)


def gpu_batch(step: int, rank: int | None, world: int, device) -> tuple:
    (x,), y = toy_batch(n=GPU_BATCH, seed=step, device=device)
    if rank is None:
        return (x,), y
    n = GPU_BATCH // world
    return (x[rank * n:(rank + 1) * n],), y[rank * n:(rank + 1) * n]


def main_cuda(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import copy

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    for mode in GPU_MODES:
        for fup in (False, True):
            torch.manual_seed(rank)  # the broadcast from rank 0 must make the weights agree
            engine = EraseEngine(Toy(d=64).to(device), gpu_plan(mode, fup), loss_fn=loss_fn, example=gpu_batch(0, rank, world, device),
                                 optimizer=functools.partial(torch.optim.Adam, lr=1e-3), process_group=dist.group.WORLD)
            for step in range(GPU_STEPS):
                before = copy.deepcopy(engine.model).cpu()
                heads = {k: copy.deepcopy(h).cpu() for k, h in engine.heads.items()}
                engine.step(*gpu_batch(step, rank, world, device))
            torch.cuda.synchronize()
            grads = {n: p.grad.detach().cpu().clone() for n, p in engine._named_parameters()}
            results[f"{mode}-fup-{'on' if fup else 'off'}"] = {"before": before, "heads": heads, "grads": grads}
            engine.close()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()



def run_ranks(world: int, out: "Path", *extra: str, timeout_s: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run this module as ``world`` rank processes (``python -m tests.runtime.ddp_worker RANK
    WORLD INIT OUT *extra``) and return each rank's saved results; a rank that fails or a hang
    past ``timeout_s`` (collectives out of order) fails the calling test."""
    import os
    import subprocess

    import pytest

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.ddp_worker", str(r), str(world), str(out / "init"),
                               str(out), *extra], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish in {timeout_s} s (a collective hung?)")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]

if __name__ == "__main__":
    entry = main_cuda if sys.argv[5:] == ["cuda"] else main
    entry(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
