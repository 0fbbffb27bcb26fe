"""Where a host-bound step's time goes: the plain loop against the engine's variants, one process.

Re-measures, on the product, the table behind the host-tax work (docs/benchmarks.md): the
user's plain training loop, twice (two copies of the same loop: what a figure's resolution is);
the same loop inside a pass-through TorchFunctionMode (what intercepting every torch call costs); the engine with an empty plan; one module placed on a
side stream; one cut (blocking, with a per-cut CUDA graph, threaded + per-cut graph,
deferred); graphed pieces (captured and replayed inside the eager step, not detached); and
the plain loop with a module wrapped by ``torch.cuda.make_graphed_callables`` by hand; a module whose
work is negligible placed (its placement costs only the runtime's own work), beside the plain loop
running that module on a side stream by hand as torch's docs show; and the plain loop doing a cut's
aux-head work by hand, its backward at once or with the main loss's (what a blocking or deferred cut
costs beyond its head is the cut minus that row). Every
variant starts from the same weights, sees the same batches, and is timed in interleaved
windows on the device (erase_tune.measure.time_interleaved); each ratio is the per-window
median-QPS ratio against the plain loop, median [lo, hi].

    python -m erase_tune.benchmarks host_table --out DIR --workload dlrm --arg batch=4096 --device cuda

(recorded with scripts/host_table.py, now this case; its JSON is DIR/host_table.json.)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from erase_tune.benchmarks.case import Context, case, opt
from erase_tune.measure import ratio_spread, time_interleaved
from erase_tune.measure.hostcpu import host_cpu_interleaved, host_tax
from erase_tune.measure.timing import ORDERS
from erase_tune.measure.trial import GRAPH_WARMUP, Variant, build_engine, jsonable_args
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.device import resolve_device
from erase_tune.workloads import get_workload, workload_args


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class _Start:
    """What every runner starts from alike: the workload, its initial model, its data and the device."""

    workload: Any
    init: torch.nn.Module
    data: Any
    device: torch.device


@dataclasses.dataclass
class WorkloadOptions:
    """The options the host cases start from (host_table, host_profile, host_trace): the workload,
    its arguments and the device."""

    workload: str = opt("dlrm", "the workload")
    arg: list[str] = opt([], "a workload argument KEY=VALUE")
    device: str = opt("auto", "device (auto, cuda, cpu)")

    def start(self) -> _Start:
        """The workload these options name, built; its data and initial model (torch seeded 0 first)."""
        workload = get_workload(self.workload, workload_args(self.arg))
        device = resolve_device(self.device)
        torch.manual_seed(0)
        data, init = workload.make_data(device), workload.build_model()
        return _Start(workload, init, data, device)


class _Plain:
    """The user's loop: zero_grad, forward, loss, backward, step (optionally under a mode, or
    with one module replaced by its hand-made graphed callable)."""

    def __init__(self, start: _Start, *, mode: bool = False, graph: str | None = None,
                 head: tuple[str, torch.nn.Module, float] | None = None, blocking: bool = False,
                 side: str | None = None) -> None:
        workload, data, device = start.workload, start.data, start.device
        self.model = copy.deepcopy(start.init).to(device)
        self.head = None
        self.blocking = blocking
        params = list(self.model.parameters())
        if head is not None:  # (module, its aux head, lambda): the cut's extra work, by hand
            module, h, self.aux_weight = head
            self.head = copy.deepcopy(h).to(device)
            params += list(self.head.parameters())
            cut = self.model.get_submodule(module)  # a cut: inputs and output detached, the head trains it
            cut.register_forward_pre_hook(lambda m, a: tuple(x.detach() for x in a))
            cut.register_forward_hook(lambda m, a, out: (self._cut_out(out), out.detach())[1])
        if side is not None:  # the module on a side stream, written as torch's docs show
            _on_side_stream(self.model.get_submodule(side), device)
        self.opt = workload.optimizer(params)
        self.loss_fn, self.data, self.mode, self.graph, self.calls = workload.loss_fn, data, mode, graph, 0

    def __call__(self, step: int) -> None:
        inputs, target = self.data.batch(step)
        if self.graph is not None and self.calls == GRAPH_WARMUP:
            self._wrap(inputs)
        self.calls += 1
        self.opt.zero_grad()
        self.target = target
        if self.mode:
            with _PassThrough():
                loss = self.loss_fn(self.model(*inputs), target)
        else:
            loss = self.loss_fn(self.model(*inputs), target)
        if self.head is not None and not self.blocking:  # what a deferred cut computes: the head on the detached output
            loss = loss + self.aux_weight * self.loss_fn(self.head(self.cut_out), target)
        loss.backward()
        self.opt.step()

    def _cut_out(self, out) -> None:
        self.cut_out = out
        if self.blocking:  # what a blocking cut does: the local loss's backward at once
            (self.aux_weight * self.loss_fn(self.head(out), self.target)).backward()

    def _wrap(self, inputs) -> None:
        seen = {}
        module = self.model.get_submodule(self.graph)
        handle = module.register_forward_pre_hook(lambda m, a: seen.setdefault("args", a))
        self.model(*inputs)  # with grad: the sample inputs must require grad as the real ones do
        handle.remove()
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in seen["args"])
        parent, _, name = self.graph.rpartition(".")
        graphed = torch.cuda.make_graphed_callables(module, sample)
        setattr(self.model.get_submodule(parent) if parent else self.model, name, graphed)


@dataclasses.dataclass
class Options(WorkloadOptions):
    place: str = opt("bot_l", "the module placed and cut")
    graph: str = opt("top_l", "the module graphed (by hand and by the engine)")
    also_graph: str = opt("bot_l", "graphed beside --graph in the last engine row")
    negligible: str = opt("auto", "a module whose work is negligible, placed on a side stream (auto: the last leaf)")
    cpu_windows: int = opt(400, "rounds of the host-CPU pass (0: none)")
    cpu_order: str = opt("rotate", "runners' order in each round of the CPU pass (rotated: a runner nearly always "
                         "follows the same one; shuffled: a fresh seeded order per round)", choices=ORDERS)
    cpu_window_steps: int = opt(1, "steps per variant per round of the host-CPU pass (1: the variants alternate "
                                "step by step, so drift between windows cancels)")
    windows: int = opt(8, "timing windows")
    window_steps: int = opt(30, "steps per window")


def _plans(a: Options, tiny: str, cuda: bool) -> dict[str, ErasePlan]:
    """The engine's variants by name: the empty plan, ``tiny`` and ``a.place`` placed, ``a.place``
    detached (blocking, deferred and, on CUDA, with per-cut graphs) and the graphed modules."""
    p = a.place
    plans = {
        "engine, empty plan": ErasePlan(),
        f"{tiny} placed (negligible work)": ErasePlan(placements=(Placement(module=tiny, stream=1),), num_streams=1),
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
    return plans


def _table(rows: list[dict], batch: int, cpu, a: Options) -> list[str]:
    """The rows as table lines (with the host CPU columns and their legend when measured)."""
    table = [f"{'variant, batch ' + str(batch):<60} {'ms/step':>8} {'vs plain loop':>22} {'host CPU µs':>12} "
             f"{'CPU tax µs [lo, hi]':>24} {'main thread':>12} {'beyond head':>12}"]
    for r in rows:
        m, lo, hi = r["vs_plain"]
        line = f"{r['variant']:<60} {r['ms_per_step']:>8.3f} {m:>8.3f}x [{lo:.3f}-{hi:.3f}]"
        if cpu is not None:
            tm, tl, th = r["cpu_tax_us"]
            over = r["cpu_tax_over_head_us"]
            line += (f" {r['cpu_us_per_step']:>12,.0f} {f'{tm:+,.0f} [{tl:+,.0f}, {th:+,.0f}]':>24}"
                     f" {r['main_thread_cpu_tax_us'][0]:>+12,.0f} {f'{over[0]:+,.0f}' if over else '-':>12}")
        table.append(line)
    if cpu is not None:
        table.append(f"host CPU: process CPU time per step, median of {a.cpu_windows} interleaved rounds of "
                     f"{a.cpu_window_steps} step(s); {cpu.how}; 'main thread': the training thread's own share of "
                     "the tax; 'beyond head': over the plain loop doing the cut's aux-head work by hand (its backward "
                     "at once for blocking rows, with the main loss's for deferred)")
    return table


@case("host_table", Options, cuda="optional", recorded_with="scripts/host_table.py",
      description="the plain loop against the engine's variants: QPS ratios and host CPU tax per step",
      figures=("00.1 Where a host-bound step's time goes, re-measured on the product",
               "00.4 The host tax as CPU time", "00.6 The stream fast path (the host table again)",
               "00.7 A lean join (host table with by-hand rows)", "00.8 Host CPU µs per step over the plain loop"))
def host_table(a: Options, ctx: Context) -> dict[str, Any]:
    start = a.start()
    workload, init, data, device = start.workload, start.init, start.data, start.device
    cuda = device.type == "cuda"
    p = a.place
    tiny = _last_leaf(init) if a.negligible == "auto" else a.negligible
    plans = _plans(a, tiny, cuda)
    runners = {"plain loop": _Plain(start),
               "plain loop, a second copy (A/A: the resolution)": _Plain(start),
               "plain loop, pass-through TorchFunctionMode": _Plain(start, mode=True)}
    if cuda:
        runners[f"plain loop, {a.graph} graphed by hand"] = _Plain(start, graph=a.graph)
        runners[f"plain loop, {tiny} on a side stream by hand"] = _Plain(start, side=tiny)
    for name, plan in plans.items():
        runners[name] = Variant(plan=plan, engine=build_engine(workload, plan, init, data, device), data=data)
    deferred = runners[f"{p} detached, deferred"].engine
    by_hand = f"plain loop + {p}'s aux head by hand"
    head = (p, deferred.heads[p], deferred.plan.cuts[0].aux_weight)
    runners[by_hand] = _Plain(start, head=head)
    by_hand_blocking = f"plain loop + {p}'s aux head by hand, its backward at once"
    runners[by_hand_blocking] = _Plain(start, head=head, blocking=True)
    t = time_interleaved(runners, device=device, warmup_steps=GRAPH_WARMUP + 5, windows=a.windows,
                         window_steps=a.window_steps)
    cpu = None
    if a.cpu_windows:
        cpu = host_cpu_interleaved(runners, device=device, warmup_steps=2, windows=a.cpu_windows,
                                   window_steps=a.cpu_window_steps, start_step=t.next_step, order=a.cpu_order)
    plain = t.variants["plain loop"]
    batch = workload.batch_size
    rows = []
    for name, v in t.variants.items():
        r = ratio_spread(v, plain, batch)
        ms = sorted(v.steps_s)[len(v.steps_s) // 2] * 1e3
        row = {"variant": name, "ms_per_step": ms, "vs_plain": [r.median, r.lo, r.hi],
               "plan": plans[name].describe() if name in plans else "plain loop"}
        if cpu is not None:
            row["cpu_us_per_step"] = cpu.median_us(name)
            row["cpu_tax_us"] = list(host_tax(cpu, name, "plain loop"))
            row["main_thread_cpu_tax_us"] = list(host_tax(cpu, name, "plain loop", main_thread=True))
            hand = by_hand if "deferred" in name else by_hand_blocking
            row["cpu_tax_over_head_us"] = list(host_tax(cpu, name, hand)) if "detached" in name else None
        rows.append(row)
    table = _table(rows, batch, cpu, a)
    return {"rows": rows, "samples": t.to_dict(), "host_cpu": cpu.to_dict() if cpu else None,
            "workload": workload.name, "workload_args": jsonable_args(workload.args), "negligible": tiny,
            "table": "\n".join(table)}


def _on_side_stream(module: torch.nn.Module, device) -> None:
    """``module``'s forward on its own stream, joined at once: the side-stream code a user writes
    by hand (wait for the inputs, run, make the caller wait, tell the allocator who reads what)."""
    forward, side = module.forward, torch.cuda.Stream(device)

    def placed(*args):
        here = torch.cuda.current_stream(device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            out = forward(*args)
        here.wait_stream(side)
        for a in args:
            a.record_stream(side)
        out.record_stream(here)
        return out

    module.forward = placed


def _last_leaf(model: torch.nn.Module) -> str:
    """The model's last registered leaf module (for dlrm: the top MLP's Sigmoid)."""
    return [n for n, m in model.named_modules() if n and not list(m.children())][-1]
