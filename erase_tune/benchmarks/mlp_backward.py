"""The paper's sanity check on our deep MLP: how much backward time and step time do the
detached pieces save?

    python -m erase_tune.benchmarks mlp_backward --out DIR [--arg width=1024 ...]

(recorded with scripts/mlp_backward.py, now this case.)

The paper reports, for a 30-layer MLP on one A100, compute-matched backward time 23.5 → 9.9 ms
(−58%) and total batch time 41.2 → 28.8 ms (−30%) with Forward-Forward-style detachment. Here
the shipped mlp workload (search_spaces/mlp.yaml sizes) runs, in one process, interleaved in
windows: the plain step (no cuts), the three pieces detached only (one backward at the end),
and the three pieces with early backward (blocking, on the main stream, and on side
streams). Per step, CUDA events split the step at the end of the model's forward on the main
stream: "backward" is from there to the end of the step's backward work (side streams
joined), "step" is the whole step without the optimizer. Medians over the timed steps.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

import torch
import yaml

from erase_tune.benchmarks.case import ROOT, Context, case, opt
from erase_tune.runtime import Cut, EraseEngine, ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.workloads import get_workload, workload_args

PIECES = ("layers.0:11", "layers.11:21")


def plans() -> dict[str, ErasePlan]:
    def cuts(streams: bool) -> tuple[Cut, ...]:
        return tuple(Cut(module=m, stream=i + 1 if streams else 0) for i, m in enumerate(PIECES))

    return {
        "no cuts": ErasePlan(),
        "detach only": ErasePlan(cuts=cuts(False), dispatch="deferred"),
        "early, main stream": ErasePlan(cuts=cuts(False), dispatch="blocking"),
        "early, side streams": ErasePlan(cuts=cuts(True), num_streams=2, dispatch="blocking"),
    }


@dataclasses.dataclass
class Options:
    device: str = opt("cuda", "device (the times are CUDA events: on the CPU the steps run untimed)")
    warmup: int = opt(10, "warm-up steps per variant")
    windows: int = opt(5, "interleaved windows")
    steps: int = opt(20, "steps per variant per window")
    arg: list[str] = opt([], "a workload argument KEY=VALUE (over search_spaces/mlp.yaml's)")


@case("mlp_backward", Options, cuda="optional", recorded_with="scripts/mlp_backward.py",
      description="the paper's deep-MLP check: backward and step time saved by the detached pieces",
      figures=("0.7 The paper's deep-MLP check, on the H200",))
def mlp_backward(ns: Options, ctx: Context) -> dict[str, Any]:
    device = resolve_device(ns.device)
    space = yaml.safe_load(ROOT.joinpath("search_spaces", "mlp.yaml").read_text())
    args = {**space["workload"]["args"], **workload_args(ns.arg)}
    wl = get_workload("mlp", args)
    torch.manual_seed(0)
    data = wl.make_data(device)
    init = wl.build_model()
    engines = {}
    for name, plan in plans().items():
        model = copy.deepcopy(init).to(device)
        engines[name] = EraseEngine(model, plan, loss_fn=wl.loss_fn, optimizer=wl.optimizer, example=data.batch(0))
    cuda = device.type == "cuda"
    times: dict[str, dict[str, list[float]]] = {n: {"backward": [], "step": []} for n in engines}

    def one(name: str, step: int, timed: bool) -> None:
        engine = engines[name]
        inputs, target = data.batch(step)
        if not cuda:
            engine.step(inputs, target)
            return
        start, fwd, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        hook = engine.model.register_forward_hook(lambda *a: fwd.record())
        start.record()
        engine.zero_grad()  # the script times the step's parts, as step() runs them
        engine.forward_backward(inputs, target)
        end.record()
        hook.remove()
        engine.optimizer.step()
        if timed:
            end.synchronize()
            times[name]["backward"].append(fwd.elapsed_time(end))
            times[name]["step"].append(start.elapsed_time(end))

    step = 0
    for name in engines:
        for _ in range(ns.warmup):
            one(name, step, False)
            step += 1
    for w in range(ns.windows):
        order = list(engines)[w % len(engines):] + list(engines)[:w % len(engines)]
        for name in order:
            for k in range(ns.steps):
                one(name, step + k, True)
        step += ns.steps
    rows = {n: {k: statistics.median(v) if v else None for k, v in t.items()} for n, t in times.items()}
    base = rows["no cuts"]
    table = ["| variant | backward (ms) | vs no cuts | step w/o optimizer (ms) | vs no cuts |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if r["step"] is None:
            continue
        table.append(f"| {name} | {r['backward']:.2f} | {r['backward'] / base['backward'] - 1:+.0%} | {r['step']:.2f} | "
                     f"{r['step'] / base['step'] - 1:+.0%} |")
    if not cuda:
        table.append(f"(no times on {device}: the steps ran, untimed; CUDA events time them on a GPU)")
    table.append("paper (one A100, 30-layer MLP on MNIST): backward 23.5 -> 9.9 ms (-58%), batch 41.2 -> 28.8 ms (-30%)")
    return {"workload_args": args, "device": str(device), "torch": torch.__version__, "rows": rows,
            "samples": times, "table": "\n".join(table)}
