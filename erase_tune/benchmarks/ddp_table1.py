"""The ERASE paper's Table 1 structure on the CTR proxy, data parallel on K GPUs of one host.

    python -m erase_tune.benchmarks ddp_table1 --out DIR [--ranks K] [--device cuda|cpu]
        [--warmup-steps 8] [--windows 5] [--window-steps 20] [--quality-steps 300]
        [--variants a,b,...] [--arg key=value ...]

(recorded with scripts/ddp_table1.py, now this case; on two GPUs: suite c.)

Spawns K ranks (torch.multiprocessing, default: every visible GPU, one per rank; rendezvous at
127.0.0.1 on a free port; nccl on CUDA with NCCL_NVLS_ENABLE=0, gloo with ``--device cpu``).
In that one process group, on the same workload, every variant is one data-parallel
:func:`~erase_tune.measure.trial.run_trial` (docs/design.md, "Data parallel"): its own baseline (DDP
eager, no cuts), the candidate, its detach-only twin and, on CUDA, the whole-step-graph
baseline, all data parallel and timed in alternating windows in the same processes. QPS counts
all ranks' examples (each rank trains a full ``batch`` per step).

Variants (all six subarchs cut or placed round robin over 4 side streams, λ = 1):

    a  ERASE blocking, find_unused_parameters off (each cut's grads all-reduced early)
    b  ERASE blocking, find_unused_parameters on (one reduction after the main backward)
    c  ERASE threaded dispatch + per-cut CUDA graphs, FUP off                  (CUDA only)
    d  whole-step graph + ERASE all six                                        (CUDA only)
    e  whole-step graph + all six placed on side streams, none detached        (CUDA only)
    f  whole-step graph + subarchs.0,1,2 detached, subarchs.3,4 placed         (CUDA only)

Per variant: p90-QPS ratio over the eager DDP baseline and over the whole-step-graph DDP
baseline (the trial's own ratios), NE gap ``(NE_cand - NE_base) / NE_base``, and the
detach-only twin's p90 ratio over the eager baseline. On the CPU the graph variants are
skipped (CUDA graphs need CUDA) and there is no graph baseline: a smoke test, not a figure.

Defaults: the workload args and the budget of search_spaces/ctr.yaml (batch 2048 per rank,
width 256, emb_dim 64, 100k rows, sub_out 64; 8 warm-up steps, 5 windows of 20 steps, 300
quality steps), except ``train_batches``: K x the steps of one trial (one pass over the data
per trial with K ranks reading disjoint batches, as ctr.yaml's one pass on one GPU). The
baseline's held-out NE is measured by the first trial and reused by the later ones (the
service's cache does the same), so only the first trial trains the baseline for quality.
Six trials at this budget are expected to take about 2-3 minutes on 2 H200s (a single-GPU
trial at these args takes ~17 s), inside suite c's 240 s for this step; not
yet measured. ``DIR/ddp_table1.json`` is rewritten after every variant, so a time limit keeps what ran.
Rank 0 prints the markdown table last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from erase_tune.benchmarks.case import CaseError, Context, case, opt
from erase_tune.measure.trial import Budget, TrialFailed
from erase_tune.runtime import Cut, ErasePlan, Placement
from erase_tune.workloads import workload_args

SUBARCHS = tuple(f"subarchs.{i}" for i in range(6))
STREAMS = 4
CTR_ARGS: dict[str, Any] = {"batch": 2048, "width": 256, "depth": 3, "emb_dim": 64, "num_tables": 26,
                            "rows": 100000, "sub_out": 64, "eval_batches": 16}
"""search_spaces/ctr.yaml's workload args, less ``train_batches`` (set from the ranks and budget)."""
CTR_BUDGET = {"warmup_steps": 8, "windows": 5, "window_steps": 20, "quality_steps": 300}
"""search_spaces/ctr.yaml's budget."""


def _stream(i: int) -> int:
    return 1 + i % STREAMS


def variants() -> dict[str, tuple[str, ErasePlan, bool]]:
    """key -> (label, plan, needs CUDA)."""
    def cuts(mods, graph=False):
        return tuple(Cut(module=m, stream=_stream(i), graph=graph) for i, m in enumerate(mods))

    six = cuts(SUBARCHS)
    return {
        "a": ("ERASE blocking, FUP off", ErasePlan(cuts=six, num_streams=STREAMS), False),
        "b": ("ERASE blocking, FUP on", ErasePlan(cuts=six, num_streams=STREAMS, find_unused_parameters=True), False),
        "c": ("ERASE threaded + per-cut graphs, FUP off",
              ErasePlan(cuts=cuts(SUBARCHS, graph=True), num_streams=STREAMS, dispatch="threaded"), True),
        "d": ("whole-step graph + ERASE all six", ErasePlan(cuts=six, num_streams=STREAMS, whole_step_graph=True), True),
        "e": ("whole-step graph + all six placed",
              ErasePlan(placements=tuple(Placement(module=m, stream=_stream(i)) for i, m in enumerate(SUBARCHS)),
                        num_streams=STREAMS, whole_step_graph=True), True),
        "f": ("whole-step graph + 3 cuts (0,1,2 detached; 3,4 placed)",
              ErasePlan(cuts=cuts(SUBARCHS[:3]),
                        placements=tuple(Placement(module=m, stream=_stream(i + 3)) for i, m in enumerate(SUBARCHS[3:5])),
                        num_streams=STREAMS, whole_step_graph=True), True),
    }


def _ratio(gain: float | None) -> float | None:
    return None if gain is None else 1.0 + gain


def _row(key: str, label: str, res) -> dict[str, Any]:
    v = res.variants
    return {
        "variant": key, "label": label, "plan": res.plan.describe(), "plan_dict": res.plan.to_dict(),
        "qps_ratio_vs_eager": _ratio(res.gain_p90),
        "qps_ratio_vs_graph": _ratio(res.gain_vs_reference),
        "ne_gap": res.ne_gap,
        "detach_only_ratio_vs_eager": _ratio(res.gain_detach_only),
        "ratio_spread_vs_eager": [_ratio(g) for g in res.gain_spread],
        "ne_baseline": res.ne_baseline, "ne_candidate": res.ne_candidate,
        "p90_qps": {name: r.p90_qps for name, r in v.items()},
        "duration_s": res.duration_s,
        "baseline_ne_cached": res.provenance.get("baseline_ne_cached"),
        "data_passes": res.provenance.get("data_passes"),
        "trial": res.to_dict(),
    }


def _x(r: float | None) -> str:
    return "–" if r is None else f"{r:.3f}x"


def markdown(rows: list[dict], skipped: list[dict], failed: list[dict], ranks: int, device_name: str) -> str:
    lines = [f"Data parallel, {ranks} ranks on {device_name}; p90 QPS of all ranks' examples; "
             "ratios are each trial's own (same processes, interleaved windows).", "",
             "| | variant | p90 QPS | its eager DDP baseline | vs eager DDP | vs whole-step-graph DDP | NE gap "
             "| detach-only twin vs eager |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        q = r["p90_qps"]
        lines.append(f"| {r['variant']} | {r['label']} | {q['candidate']:,.0f} | {q['baseline']:,.0f} "
                     f"| {_x(r['qps_ratio_vs_eager'])} | {_x(r['qps_ratio_vs_graph'])} | {r['ne_gap']:+.2%} "
                     f"| {_x(r['detach_only_ratio_vs_eager'])} |")
    if skipped or failed:
        lines.append("")
    for s in skipped:
        lines.append(f"- {s['variant']} ({s['label']}): skipped, {s['why']}")
    for f in failed:
        lines.append(f"- {f['variant']} ({f['label']}): FAILED, {f['error']}")
    return "\n".join(lines)


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, ns: Options, world: int) -> tuple[torch.device, Any]:
    """This rank's device (its GPU, or the CPU with its share of the threads) and the process
    group of all ``world`` ranks (nccl on CUDA, gloo on the CPU), joined."""
    import torch.distributed as dist

    if ns.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if ns.device == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world, timeout=timedelta(seconds=ns.collective_timeout))
    return device, dist.group.WORLD


def _print_row(key: str, label: str, r: dict[str, Any]) -> None:
    print(f"{key} {label}: vs eager {_x(r['qps_ratio_vs_eager'])}, vs graph {_x(r['qps_ratio_vs_graph'])}, "
          f"NE gap {r['ne_gap']:+.2%}, twin {_x(r['detach_only_ratio_vs_eager'])} ({r['duration_s']:.1f}s)",
          flush=True)


def rank_main(rank: int, ns: Options, world: int, args: dict[str, Any], argv: list[str], out: str) -> None:
    import torch.distributed as dist

    from erase_tune.measure import provenance
    from erase_tune.measure.trial import run_trial
    from erase_tune.workloads import get_workload

    cuda = ns.device == "cuda"
    device, group = _join_group(rank, ns, world)
    budget = Budget(warmup_steps=ns.warmup_steps, windows=ns.windows, window_steps=ns.window_steps,
                    quality_steps=ns.quality_steps, seed=ns.seed)
    workload = get_workload("ctr", args)
    prov = provenance(device, ranks=world, backend=dist.get_backend(group), workload="ctr", args=args,
                      budget=dataclasses.asdict(budget), command=[sys.executable, *argv],
                      nccl=_nccl_version() if cuda else None,
                      nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    chosen = [k.strip() for k in ns.variants.split(",") if k.strip()]
    rows: list[dict] = []
    skipped: list[dict] = []
    failed: list[dict] = []

    def save(complete: bool) -> None:
        if rank != 0:
            return
        doc = {"provenance": prov, "ranks": world, "device": str(device), "args": args,
               "budget": dataclasses.asdict(budget), "complete": complete, "variants": rows,
               "skipped": skipped, "failed": failed,
               "table": markdown(rows, skipped, failed, world, prov["device_name"])}
        path = Path(out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(path)

    table = variants()
    baseline_ne = None
    for key in chosen:
        label, plan, needs_cuda = table[key]
        if needs_cuda and not cuda:
            skipped.append({"variant": key, "label": label, "why": "CUDA graphs need CUDA (run with --device cuda)"})
            continue
        try:
            res = run_trial(workload, plan, budget, device, baseline_ne=baseline_ne, process_group=group)
        except TrialFailed as e:  # raised on every rank alike (the trial checks finiteness across the group)
            failed.append({"variant": key, "label": label, "error": " ".join(str(e).split())[:300]})
            save(False)
            continue
        baseline_ne = res.ne_baseline
        rows.append(_row(key, label, res))
        if rank == 0:
            _print_row(key, label, rows[-1])
        save(False)
    save(True)
    dist.barrier(group)
    dist.destroy_process_group()
    # The table is printed last by the runner; a failed variant fails the run there (from the
    # file rank 0 wrote), not by a rank exiting non-zero (which makes spawn stop the others).


@dataclasses.dataclass
class Options:
    ranks: int | None = opt(None, "ranks (default: every visible GPU; 2 on the CPU)")
    device: str = opt("cuda", "cuda, or cpu for the smoke test (gloo)", choices=("cuda", "cpu"))
    warmup_steps: int = opt(CTR_BUDGET["warmup_steps"], "warm-up steps")
    windows: int = opt(CTR_BUDGET["windows"], "timing windows")
    window_steps: int = opt(CTR_BUDGET["window_steps"], "steps per window")
    quality_steps: int = opt(CTR_BUDGET["quality_steps"], "training steps for the NE gap")
    seed: int = opt(0, "seed")
    variants: str = opt(",".join("abcdef"), "which of a..f, comma separated")
    collective_timeout: float = opt(300.0, "seconds a rank waits at a collective")
    arg: list[str] = opt([], "override a ctr workload argument KEY=VALUE")


@case("ddp_table1", Options, cuda="optional", gpus=2, recorded_with="scripts/ddp_table1.py",
      description="the ERASE paper's Table 1 structure on the CTR proxy, data parallel over the visible GPUs",
      figures=("0.9 Owed from this campaign (the two-GPU Table 1; suite c)",))
def ddp_table1(ns: Options, ctx: Context) -> dict[str, Any]:
    argv = list(ctx.argv)
    unknown = [k for k in ns.variants.split(",") if k.strip() and k.strip() not in variants()]
    if unknown:
        raise CaseError(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(variants())})")
    if ns.device == "cuda":
        if not torch.cuda.is_available():
            raise CaseError("--device cuda: no CUDA device here (use --device cpu for the smoke test)")
        ranks = ns.ranks or torch.cuda.device_count()
        if ranks > torch.cuda.device_count():
            raise CaseError(f"--ranks {ranks}: only {torch.cuda.device_count()} GPUs are visible")
    else:
        ranks = ns.ranks or 2
    if ranks < 1:
        raise CaseError("--ranks must be >= 1")
    budget = Budget(warmup_steps=ns.warmup_steps, windows=ns.windows, window_steps=ns.window_steps,
                    quality_steps=ns.quality_steps, seed=ns.seed)  # refuses a bad budget before spawning
    overrides = workload_args(ns.arg)
    args = {**CTR_ARGS, "train_batches": ranks * budget.training_steps, **overrides}
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any rank initialises NCCL (the children inherit it)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    print(f"ddp_table1: {ranks} ranks on {ns.device}, ctr {args}, budget {dataclasses.asdict(budget)}", flush=True)
    import torch.multiprocessing as mp

    out = ctx.path(".json")  # rank 0 writes the table here as it goes; the runner rewrites it at the end
    ctx.save({"ranks": ranks, "complete": False})
    procs = mp.spawn(rank_main, args=(ns, ranks, args, argv, str(out)), nprocs=ranks, join=False)

    def stop(signum, frame):  # a time limit (`timeout` sends SIGTERM) must not leave ranks holding GPUs
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(10)
        print(f"ddp_table1: stopped by signal {signum}; DIR/ddp_table1.json holds the variants done",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not procs.join():
            pass
    except mp.ProcessExitedException as e:
        raise CaseError(f"error: {' '.join(str(e).split())}") from None
    except mp.ProcessRaisedException as e:
        raise CaseError(f"error: a rank failed:\n{e}") from None
    doc = json.loads(out.read_text())
    if doc.get("failed"):
        ctx.rc = 1
    return doc
