"""The runtime's variants side by side on one workload (``erase-tune bench``).

Answers "what does each way of running ERASE buy on this workload and device?": a plain
hand-written training loop, the eager baseline (engine, no cuts), the whole-step-graph
baseline, ERASE blocking / threaded / per-cut graphs, and whole-step graph with the cut
modules placed on side streams only (not detached: gradients unchanged), detached only (one
stream, no early launch), or with full ERASE. All variants start from the same weights, see the same
batches, and are timed in alternating windows in one process, by the sequential protocol every
gain comes from (:func:`erase_tune.measure.measure_gains`: every row against the eager baseline,
and the graph baseline where it runs; at least ``budget.windows`` windows, then each row until
its gain's 95% interval over the eager baseline is at most ``±budget.halfwidth``, at most
``budget.max_windows``); every speed-up is a per-window ratio of window-median QPS against the
eager and the graph baseline, reported as median [lo, hi] over the windows.
With ``trace_dir`` the ERASE variants are then profiled for a few steps and the cross-stream
overlap (overlapped time / side-stream busy time) is read off the trace.

The host-cost rows show what the runtime's own host work costs on the user's model: the plain
loop, the engine with an empty plan (the eager baseline), one placement and one blocking cut of
the cheapest candidate (fewest parameters), each as ms/step and the difference to the plain
loop in µs/step (per-window medians, so slow drift cancels), and, measured again in a pass of
their own where they alternate step by step, the process's CPU time per step with device waits left out and its difference to the
plain loop (:mod:`erase_tune.measure.hostcpu`): a host-bound step's wall time spreads too much
from window to window to show a tax of tens of µs, its CPU time does not. On a host-bound model
this tax, not the overlap, decides whether ERASE can win.

On CUDA the whole-step graph is tried once first (:func:`erase_tune.measure.trial.reference_capture_error`);
a model whose step cannot be captured whole loses its graph rows, and the reason is kept in
``BenchResult.graph_error``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from erase_tune.errors import EraseTuneError, one_line, shown
from erase_tune.measure import (
    measure_gains,
    profile_steps,
    provenance,
    qps_summary,
)
from erase_tune.measure.hostcpu import host_cpu_interleaved, host_tax
from erase_tune.measure.protocol import ProtocolResult
from erase_tune.runtime import Cut, ErasePlan, Placement
from erase_tune.runtime.probing import ProbeResult, probe
from erase_tune.runtime.device import resolve_device
from erase_tune.measure.trial import (
    Budget,
    Variant,
    build_engine,
    capture_error,
    jsonable_args,
    reference_capture_error,
    release,
)
from erase_tune.workloads import Workload, WorkloadData

__all__ = ["BenchRow", "BenchResult", "bench_plans", "run_bench", "choose_cuts", "detachable", "disjoint_cuts", "cheapest",
           "HOST_ROWS"]

PLAIN = "plain loop"
EAGER = "eager baseline"
GRAPH = "graph baseline"
TRACED = ("ERASE threaded", "graph + placement only", "graph + ERASE")
ONE_PLACEMENT = "one placement"
ONE_CUT = "one cut (blocking)"
HOST_ROWS = (PLAIN, EAGER, ONE_PLACEMENT, ONE_CUT)
"""The rows of the host-cost section, in order."""
HOST_STEPS = 200
"""Steps per host-cost row in the host-CPU pass at least, the rows alternating step by step: on a
host-bound step both wall and CPU time drift by ±10-20% between 30-step windows, so only
neighbouring steps compare."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchRow:
    name: str
    plan: str
    p90_qps: float
    median_qps: float
    vs_eager: tuple[float, float, float]
    """Per-window median-QPS ratio over the eager baseline: (median, lo, hi)."""
    vs_graph: tuple[float, float, float] | None
    """The same over the whole-step-graph baseline, where that ran."""
    overlap: float | None = None
    """Overlapped time / side-stream busy time from a profiler trace, where traced."""
    ms_per_step: float = 0.0
    """Median step time, milliseconds."""
    vs_plain_us: float | None = None
    """Median over windows of (this row's median step time - the plain loop's), µs per step."""
    host_cpu_us: float | None = None
    """Host-cost rows: the process's CPU time per step, µs, device waits left out
    (:mod:`erase_tune.measure.hostcpu`), median over its own pass, the rows alternating step by step."""
    host_tax_us: tuple[float, float, float] | None = None
    """Host-cost rows: (median, lo, hi) over windows of this row's host CPU µs/step minus the plain loop's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchResult:
    workload: str
    batch_size: int
    rows: tuple[BenchRow, ...]
    samples: Mapping[str, Mapping[str, list]]
    provenance: Mapping[str, Any]
    graph_error: str | None = None
    """Why the whole-step-graph rows were left out (the step cannot be captured whole), or None."""
    host_cpu: str | None = None
    """How the host-cost rows' CPU time was measured (whether device waits were left out)."""
    skipped: tuple[tuple[str, str], ...] = ()
    """Rows that cannot run on this model and were left out: (row, why), one line each."""
    left_out: tuple[tuple[str, str], ...] = ()
    """Candidates the ERASE rows do not cut (bench chose the cuts): (candidate, why)."""

    def row(self, name: str) -> BenchRow:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "batch_size": self.batch_size,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "samples": {k: dict(v) for k, v in self.samples.items()},
            "provenance": dict(self.provenance),
            "graph_error": self.graph_error,
            "host_cpu": self.host_cpu,
            "skipped": [list(x) for x in self.skipped],
            "left_out": [list(x) for x in self.left_out],
        }

    def table(self) -> str:
        head = f"{'variant':<22} {'p90 QPS':>12} {'median QPS':>12} {'vs eager':>22} {'vs graph':>22} {'overlap':>8}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            vg = _ratio(r.vs_graph) if r.vs_graph else "-"
            ov = f"{r.overlap:.0%}" if r.overlap is not None else "-"
            lines.append(f"{r.name:<22} {r.p90_qps:>12,.0f} {r.median_qps:>12,.0f} {_ratio(r.vs_eager):>22} {vg:>22} {ov:>8}")
        return "\n".join(lines)

    def host_table(self) -> str:
        """The host-cost section: ms/step of the host-cost rows and their tax over the plain loop."""
        rows = [r for name in HOST_ROWS for r in self.rows if r.name == name]
        if not rows:
            return ""
        head = (f"{'host cost':<22} {'ms/step':>10} {'vs plain loop':>16} {'host CPU µs':>12} "
                f"{'CPU tax µs [lo, hi]':>24}  plan")
        lines = [head, "-" * len(head)]
        for r in rows:
            tax = "-" if r.vs_plain_us is None or r.name == PLAIN else f"{r.vs_plain_us:+,.0f} µs/step"
            cpu = "-" if r.host_cpu_us is None else f"{r.host_cpu_us:,.0f}"
            ctax = ("-" if r.host_tax_us is None or r.name == PLAIN
                    else f"{r.host_tax_us[0]:+,.0f} [{r.host_tax_us[1]:+,.0f}, {r.host_tax_us[2]:+,.0f}]")
            lines.append(f"{r.name:<22} {r.ms_per_step:>10.3f} {tax:>16} {cpu:>12} {ctax:>24}  {r.plan}")
        if self.host_cpu:
            lines.append(f"(host CPU: the process's CPU time per step, in windows of their own; {self.host_cpu})")
        return "\n".join(lines)


def _ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f}x [{r[1]:.2f}-{r[2]:.2f}]"


def detachable(candidates: Sequence[str], model: torch.nn.Module, workload: Workload,
               data: WorkloadData) -> list[str]:
    """Candidates cut together, upstream first (see :func:`choose_cuts`), judged by one probe
    forward of ``model``."""
    return choose_cuts(_probe(candidates, model, workload, data), candidates)[0]


def choose_cuts(found: ProbeResult, candidates: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``(cuts, left out)``: candidates cut together, upstream first, each one that can be cut (a
    module that produces the model's output, or returns more than one tensor, can only be placed
    or graphed), does not overlap those before it, and with them leaves no parameter untrained
    and the main loss a gradient path; and why each other candidate was left out (one line each)."""
    keep: list[str] = []
    left_out: dict[str, str] = {}
    for c in candidates:
        try:
            found.check_plan(ErasePlan(cuts=tuple(Cut(module=m) for m in [*keep, c])))
        except EraseTuneError as e:  # cannot be cut, overlaps one kept, starves, or cuts the output off
            left_out[c] = one_line(str(e), 300)
            continue
        keep.append(c)
    return keep, left_out


def _probe(candidates: Sequence[str], model: torch.nn.Module, workload: Workload, data: WorkloadData) -> ProbeResult:
    inputs, _ = data.batch(0)
    return probe(model, inputs if isinstance(inputs, tuple) else (inputs,), list(candidates),
                 output=workload.output, model_loss=workload.model_loss)


def disjoint_cuts(candidates: Sequence[str]) -> list[str]:
    """Greedily pick candidates that do not overlap (a plan may not cut a module twice)."""
    chosen: list[str] = []
    for name in candidates:
        trial = [*chosen, name]
        try:
            ErasePlan(cuts=tuple(Cut(module=c) for c in trial))
        except EraseTuneError:
            continue
        chosen = trial
    return chosen


def cheapest(candidates: Sequence[str], model: torch.nn.Module) -> str:
    """The candidate with the fewest parameters (its own work is the smallest, so a row that
    places or cuts it shows mostly the runtime's host cost); the first one on a tie."""
    modules = dict(model.named_modules())

    def size(name: str) -> int:
        members = Cut(module=name).members
        return sum(p.numel() for m in members if m in modules for p in modules[m].parameters())

    return min(candidates, key=size)


def bench_plans(cuts: Sequence[str], streams: int, device: torch.device, host: str | None = None, *,
                host_cut: str | None = None) -> dict[str, ErasePlan | None]:
    """The variants ``erase-tune bench`` compares (``None`` is the plain hand-written loop);
    ``host``: the candidate the host-cost rows place and, unless ``host_cut`` names another (one
    that can be cut alone), cut (no host-cost rows without it). No ``cuts``: no ERASE rows."""
    if streams < 1:
        raise EraseTuneError(f"bench: streams must be >= 1, got {streams}")

    def erase(graph: bool = False, **kw: Any) -> ErasePlan:
        cs = tuple(Cut(module=c, stream=1 + i % streams, graph=graph) for i, c in enumerate(cuts))
        return ErasePlan(cuts=cs, num_streams=streams, **kw)

    plans: dict[str, ErasePlan | None] = {PLAIN: None, EAGER: ErasePlan()}
    if host is not None:
        plans[ONE_PLACEMENT] = ErasePlan(placements=(Placement(module=host, stream=1),), num_streams=1)
    if host_cut or host:
        plans[ONE_CUT] = ErasePlan(cuts=(Cut(module=host_cut or host, stream=1),), num_streams=1,
                                   dispatch="blocking")
    cuda = device.type == "cuda"
    if cuda:
        plans[GRAPH] = ErasePlan(whole_step_graph=True)
    if not cuts:
        return plans
    plans["ERASE blocking"] = erase(dispatch="blocking")
    plans["ERASE threaded"] = erase(dispatch="threaded")
    if cuda:
        plans["ERASE per-cut graphs"] = erase(graph=True, dispatch="threaded")
        plans["graph + placement only"] = ErasePlan(
            placements=tuple(Placement(module=c, stream=1 + i % streams) for i, c in enumerate(cuts)),
            num_streams=streams, whole_step_graph=True)
        plans["graph + detach only"] = dataclasses.replace(erase().detach_only(), whole_step_graph=True)
        plans["graph + ERASE"] = erase(dispatch="blocking", whole_step_graph=True)
    return plans


class _PlainLoop:
    """What a user writes by hand: zero_grad, forward, loss, backward, step."""

    def __init__(self, workload: Workload, init: torch.nn.Module, data: WorkloadData, device: torch.device):
        self.model = copy.deepcopy(init).to(device)
        self.optimizer = workload.optimizer(self.model.parameters())
        self.training_loss = workload.training_loss
        self.data = data

    def __call__(self, step: int) -> None:
        inputs, target = self.data.batch(step)
        self.optimizer.zero_grad()
        self.training_loss(self.model(*inputs), target).backward()
        self.optimizer.step()


def _trace_dir(path: str | Path) -> Path:
    """``path``, created if missing; one line if traces cannot be written there."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".erase-tune-trace.", dir=out)  # permission bits do not tell
        os.close(fd)
        os.unlink(probe)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        reason = getattr(e, "strerror", None) or str(e)
        raise EraseTuneError(f"--trace: cannot write traces in {one_line(str(out), 300)}: {reason}") from None
    return out


def run_bench(
    workload: Workload,
    *,
    budget: Budget = Budget(),
    device: str | torch.device | None = None,
    cuts: Sequence[str] | None = None,
    streams: int = 4,
    trace_dir: str | Path | None = None,
    only: Sequence[str] | None = None,
) -> BenchResult:
    """Time every variant of :func:`bench_plans` that can run on ``workload``; see the module
    docstring. A row that cannot run is left out with one line saying why
    (:attr:`BenchResult.skipped`); the rest are timed."""
    if trace_dir is not None:  # before anything runs: a --trace that cannot be written fails at once
        trace_dir = _trace_dir(trace_dir)
    device = resolve_device(device)
    if cuts:
        bench_plans(list(cuts), streams, device)  # overlapping cuts or bad streams: refused before anything runs
    # Before anything else runs in this process (a failed capture can upset the CUDA RNG).
    graph_error = reference_capture_error(workload, device, seed=budget.seed)
    torch.manual_seed(budget.seed)
    data = workload.make_data(device)
    init = workload.build_model()
    rows = _choose_rows(workload, init, data, device, cuts=cuts, streams=streams, seed=budget.seed,
                        whole_step=graph_error is None)
    plans = _only(rows, only)
    measured, cpu, overlap = _time_rows(workload, plans, init, data, device, budget, trace_dir)
    timings = measured.timings
    return BenchResult(
        workload=workload.name,
        batch_size=workload.batch_size,
        rows=_bench_rows(measured, plans, workload.batch_size, cpu, overlap),
        samples={k: v.to_dict() for k, v in timings.variants.items()},
        provenance=provenance(device, workload=workload.name,
                              workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), cuts=rows.cuts, streams=streams),
        graph_error=graph_error,
        host_cpu=cpu.how if cpu is not None else None,
        skipped=tuple(rows.skipped.items()),
        left_out=tuple(rows.left_out.items()),
    )


def _only(rows: _Rows, only: Sequence[str] | None) -> dict[str, ErasePlan | None]:
    """The rows to time: ``--only``'s (each checked to be a row) and the eager and graph rows they
    are compared with; every row without ``--only``."""
    plans = rows.plans
    if only:
        known = [*rows.plans, *rows.skipped]
        unknown = [n for n in only if n not in known]
        if unknown:
            raise EraseTuneError(f"bench: unknown variant {shown(unknown[0])} (variants: {', '.join(known)})")
        plans = {n: p for n, p in plans.items() if n in only or n in (EAGER, GRAPH)}
    if len(plans) == 1:
        raise EraseTuneError(f"bench: --only must name a variant besides the {EAGER}, to compare with it")
    return plans


def _bench_rows(measured: ProtocolResult, plans: Mapping[str, ErasePlan | None], batch: int,
                cpu: Any, overlap: Mapping[str, float]) -> tuple[BenchRow, ...]:
    """One :class:`BenchRow` per timed row: its QPS, its gains over eager and graph, its overlap
    and, where measured, its host CPU time."""
    timings = measured.timings
    plain = timings.variants.get(PLAIN)
    out = []
    for name, t in timings.variants.items():
        s = qps_summary(t.steps_s, batch)
        plan = plans[name]
        out.append(BenchRow(
            name=name,
            plan=plan.describe() if plan is not None else "hand-written loop, no engine",
            p90_qps=s.p90, median_qps=s.median,
            vs_eager=_spread(measured, name, EAGER),
            vs_graph=_spread(measured, name, GRAPH) if GRAPH in timings.variants else None,
            overlap=overlap.get(name),
            ms_per_step=statistics.median(t.steps_s) * 1e3,
            vs_plain_us=_window_difference(t, plain) * 1e6 if plain is not None else None,
            host_cpu_us=cpu.median_us(name) if cpu is not None and name in cpu.per_window else None,
            host_tax_us=host_tax(cpu, name, PLAIN) if cpu is not None and name in cpu.per_window else None,
        ))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Rows:
    plans: dict[str, ErasePlan | None]
    """The rows that can run, in order (None: the plain loop)."""
    skipped: dict[str, str]
    """Rows that cannot run on this model, and why (one line each)."""
    cuts: list[str]
    left_out: dict[str, str]
    """Candidates left out of the ERASE rows' cuts, and why."""


def _choose_rows(workload: Workload, init: torch.nn.Module, data: WorkloadData, device: torch.device, *,
                 cuts: Sequence[str] | None, streams: int, seed: int, whole_step: bool) -> _Rows:
    """The rows of :func:`bench_plans` this model can run: the cuts are the user's, else the
    candidates that can be detached together (:func:`choose_cuts`); the host-cost rows place the
    cheapest candidate that can be placed and cut the cheapest that can be cut alone; every row is
    checked as a trial checks its plan (and, on CUDA, a row with graphs is captured once), and a
    row that fails is skipped with its reason instead of refusing the whole bench. Without
    ``whole_step`` (the step cannot be captured whole: said once, not per row) the whole-step
    rows are left out."""
    candidates = list(cuts) if cuts else list(workload.cut_candidates)
    for c in candidates:  # a name that is no module of the model is the user's typo: refused
        ErasePlan(cuts=(Cut(module=c),)).check_model(init)
    found = _probe(candidates, copy.deepcopy(init).to(device), workload, data)
    chosen, left_out = (list(cuts), {}) if cuts else choose_cuts(found, candidates)
    placeable = [c for c in candidates
                 if _passes(found.check_plan, ErasePlan(placements=(Placement(module=c, stream=1),), num_streams=1))]
    alone = [c for c in candidates if _passes(found.check_plan, ErasePlan(cuts=(Cut(module=c),)))]
    host = cheapest(placeable, init) if placeable else None
    host_cut = cheapest(alone, init) if alone else None
    plans = {n: p for n, p in bench_plans(chosen, streams, device, host=host, host_cut=host_cut).items()
             if whole_step or p is None or not p.whole_step_graph}
    skipped: dict[str, str] = {}
    if not chosen:
        skipped["ERASE rows"] = f"no candidate can be detached ({'; '.join(f'{c}: {r}' for c, r in left_out.items())})"
    if host is None:
        skipped[ONE_PLACEMENT] = f"no candidate can be placed ({', '.join(candidates) or 'none listed'})"
    for name, plan in plans.items():
        if plan is None:
            continue
        try:
            plan.check_model(init)
            found.check_plan(plan)
        except EraseTuneError as e:
            skipped[name] = one_line(str(e), 300)
            continue
        graphs = plan.whole_step_graph or plan.graphs or any(c.graph for c in plan.cuts)
        if device.type == "cuda" and graphs and name != GRAPH:  # (the graph baseline was tried first)
            error = capture_error(workload, plan, device, seed=seed, init=init, data=data)
            if error is not None:
                skipped[name] = error
    return _Rows(plans={n: p for n, p in plans.items() if n not in skipped}, skipped=skipped, cuts=chosen,
                 left_out=left_out)


def _passes(check: Any, plan: ErasePlan) -> bool:
    try:
        check(plan)
    except EraseTuneError:
        return False
    return True


def _time_rows(workload: Workload, plans: Mapping[str, ErasePlan | None], init: torch.nn.Module,
               data: WorkloadData, device: torch.device, budget: Budget,
               trace_dir: Path | None) -> tuple[ProtocolResult, Any, dict[str, float]]:
    """Every row timed by the sequential protocol, the host-cost rows' CPU time, and the traced
    rows' overlap."""
    runners: dict[str, Any] = {}
    overlap: dict[str, float] = {}
    try:
        for name, plan in plans.items():
            runners[name] = (_PlainLoop(workload, init, data, device) if plan is None
                             else Variant(plan=plan, engine=build_engine(workload, plan, init, data, device), data=data))
        over = (EAGER, GRAPH) if GRAPH in runners else (EAGER,)
        pairs = {name: tuple(o for o in over if o != name) for name in runners}
        measured = measure_gains(runners, device=device, steps=budget.steps(), rule=budget.stop_rule(),
                                 pairs={name: refs for name, refs in pairs.items() if refs})
        host = {n: runners[n] for n in HOST_ROWS if n in runners}
        cpu = host_cpu_interleaved(host, device=device, warmup_steps=1,
                                   windows=max(budget.windows * budget.window_steps, HOST_STEPS), window_steps=1,
                                   start_step=measured.timings.next_step) if PLAIN in host and len(host) > 1 else None
        if trace_dir is not None:
            for name in TRACED:
                if name in runners:
                    path = Path(trace_dir) / f"{name.replace(' ', '_').replace('+', 'plus')}.json"
                    report = profile_steps(runners[name], steps=5, start_step=measured.timings.next_step,
                                           trace_path=path)
                    overlap[name] = report.overlap_fraction
    finally:
        release(runners.values(), device)
        runners.clear()
    return measured, cpu, overlap


def _spread(measured: ProtocolResult, name: str, over: str) -> tuple[float, float, float]:
    """(median, lo, hi) over windows of ``name``'s window-median QPS ratio to ``over``'s (1 for itself)."""
    if name == over:
        return (1.0, 1.0, 1.0)
    ratios = [1.0 + g for g in measured.vs(name, over).per_window]
    return (statistics.median(ratios), min(ratios), max(ratios))


def _window_difference(t: Any, plain: Any) -> float:
    """Median over windows of (median step time of ``t`` - that of ``plain``), seconds."""
    diffs = []
    for w in sorted(set(t.window)):
        mine = [s for s, k in zip(t.steps_s, t.window) if k == w]
        base = [s for s, k in zip(plain.steps_s, plain.window) if k == w]
        if mine and base:
            diffs.append(statistics.median(mine) - statistics.median(base))
    return statistics.median(diffs)
