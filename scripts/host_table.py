"""Where a host-bound step's time goes: the plain loop against the engine's variants, one process.

Re-measures, on the product, the table behind the host-tax work (docs/benchmarks.md): the
user's plain training loop; the same loop inside a pass-through TorchFunctionMode (what
intercepting every torch call costs); the engine with an empty plan; one module placed on a
side stream; one cut (blocking, with a per-cut CUDA graph, threaded + per-cut graph,
deferred); graphed pieces (captured and replayed inside the eager step, not detached); and
the plain loop with a module wrapped by ``torch.cuda.make_graphed_callables`` by hand. Every
variant starts from the same weights, sees the same batches, and is timed in interleaved
windows on the device (erase_tune.measure.time_interleaved); each ratio is the per-window
median-QPS ratio against the plain loop, median [lo, hi].

    python scripts/host_table.py --workload dlrm --arg batch=4096 --device cuda --out host.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from erase_tune.measure import provenance, ratio_spread, time_interleaved  # noqa: E402
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement  # noqa: E402
from erase_tune.runtime.device import resolve_device  # noqa: E402
from erase_tune.trial import GRAPH_WARMUP, Variant, build_engine, jsonable_args  # noqa: E402
from erase_tune.workloads import get_workload  # noqa: E402


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Plain:
    """The user's loop: zero_grad, forward, loss, backward, step (optionally under a mode, or
    with one module replaced by its hand-made graphed callable)."""

    def __init__(self, workload, init, data, device, *, mode: bool = False, graph: str | None = None) -> None:
        self.model = copy.deepcopy(init).to(device)
        self.opt = workload.optimizer(self.model.parameters())
        self.loss_fn, self.data, self.mode, self.graph, self.calls = workload.loss_fn, data, mode, graph, 0

    def __call__(self, step: int) -> None:
        inputs, target = self.data.batch(step)
        if self.graph is not None and self.calls == GRAPH_WARMUP:
            self._wrap(inputs)
        self.calls += 1
        self.opt.zero_grad()
        if self.mode:
            with _PassThrough():
                loss = self.loss_fn(self.model(*inputs), target)
        else:
            loss = self.loss_fn(self.model(*inputs), target)
        loss.backward()
        self.opt.step()

    def _wrap(self, inputs) -> None:
        seen = {}
        module = self.model.get_submodule(self.graph)
        handle = module.register_forward_pre_hook(lambda m, a: seen.setdefault("args", a))
        with torch.no_grad():
            self.model(*inputs)
        handle.remove()
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in seen["args"])
        parent, _, name = self.graph.rpartition(".")
        graphed = torch.cuda.make_graphed_callables(module, sample)
        setattr(self.model.get_submodule(parent) if parent else self.model, name, graphed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="dlrm")
    ap.add_argument("--arg", action="append", default=[], help="workload argument key=value")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--place", default="bot_l", help="the module placed and cut")
    ap.add_argument("--graph", default="top_l", help="the module graphed (by hand and by the engine)")
    ap.add_argument("--also-graph", default="bot_l", help="graphed beside --graph in the last engine row")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-steps", type=int, default=30)
    ap.add_argument("--out")
    a = ap.parse_args()
    args = {k: _value(v) for k, v in (s.split("=", 1) for s in a.arg)}
    workload = get_workload(a.workload, args)
    device = resolve_device(a.device)
    torch.manual_seed(0)
    data, init = workload.make_data(device), workload.build_model()
    cuda = device.type == "cuda"
    p = a.place
    plans = {
        "engine, empty plan": ErasePlan(),
        f"{p} placed (side stream)": ErasePlan(placements=(Placement(module=p, stream=1),), num_streams=1),
        f"{p} detached, blocking": ErasePlan(cuts=(Cut(module=p),)),
        f"{p} detached, deferred": ErasePlan(cuts=(Cut(module=p),), dispatch="deferred"),
    }
    if cuda:
        plans[f"{p} detached, blocking, per-cut graph"] = ErasePlan(cuts=(Cut(module=p, graph=True),))
        plans[f"{p} detached, threaded, per-cut graph"] = ErasePlan(cuts=(Cut(module=p, graph=True),), dispatch="threaded")
    plans[f"{a.graph} graphed (engine)"] = ErasePlan(graphs=(Graphed(module=a.graph),))
    plans[f"{a.graph} + {a.also_graph} graphed (engine)"] = ErasePlan(
        graphs=(Graphed(module=a.graph), Graphed(module=a.also_graph)))
    runners = {"plain loop": _Plain(workload, init, data, device),
               "plain loop, pass-through TorchFunctionMode": _Plain(workload, init, data, device, mode=True)}
    if cuda:
        runners[f"plain loop, {a.graph} graphed by hand"] = _Plain(workload, init, data, device, graph=a.graph)
    for name, plan in plans.items():
        runners[name] = Variant(plan=plan, engine=build_engine(workload, plan, init, data, device), data=data)
    t = time_interleaved(runners, device=device, warmup_steps=GRAPH_WARMUP + 5, windows=a.windows,
                         window_steps=a.window_steps)
    plain = t.variants["plain loop"]
    batch = workload.batch_size
    rows = []
    for name, v in t.variants.items():
        r = ratio_spread(v, plain, batch)
        ms = sorted(v.steps_s)[len(v.steps_s) // 2] * 1e3
        rows.append({"variant": name, "ms_per_step": ms, "vs_plain": [r.median, r.lo, r.hi],
                     "plan": plans[name].describe() if name in plans else "plain loop"})
    base = rows[0]["ms_per_step"]
    print(f"{'variant, batch ' + str(batch):<52} {'ms/step':>8} {'µs vs plain':>12} {'vs plain loop':>22}")
    for r in rows:
        m, lo, hi = r["vs_plain"]
        print(f"{r['variant']:<52} {r['ms_per_step']:>8.3f} {1e3 * (r['ms_per_step'] - base):>+12.0f} "
              f"{m:>8.3f}x [{lo:.3f}-{hi:.3f}]")
    if a.out:
        prov = provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                          windows=a.windows, window_steps=a.window_steps)
        Path(a.out).write_text(json.dumps({"rows": rows, "samples": t.to_dict(), "provenance": prov}, indent=1))


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    main()
