"""One trial: a candidate plan against the baseline, measured side by side in one process.

The numbers users act on come from here, so the protocol follows the measurement
rules of docs/design.md: baseline (no cuts), candidate, its "detach only" twin (same cuts, no early launch)
and the best non-detached reference (whole-step CUDA graph, no cuts; CUDA only) all start
from the same weights, see the same batches, and are timed on the device in alternating
windows after warm-up. Gains are ratios of those samples: p90 and median of per-step QPS,
with the spread of the per-window ratio. Quality is held-out NE of baseline and candidate
after the same training steps; the NE gap is ``(NE_cand - NE_base) / NE_base``.

With ``process_group`` (a trial of k ranks): every rank runs the same protocol, every variant
(baseline included) averages its gradients across the group (:class:`EraseEngine`'s
``process_group``), rank r trains step s on batch ``s·k + r`` (each rank a full ``batch``: the
workload's batch is per rank), and QPS counts all ranks' examples (k·batch per step, timed on
this rank; the step's collectives keep the ranks in step). Every rank returns the same NE;
the service keeps rank 0's result.

Not every step can be captured whole (a forward that builds an index tensor on the host, as the
reference DLRM's interaction does, or reads a value back). :func:`reference_capture_error`
tries the whole-step graph once, before anything else runs in the process, and says why it
cannot be captured; a trial then leaves the reference out and records that reason
(``TrialResult.reference_error``) instead of failing.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from erase_tune.errors import CaptureError, EraseTuneError, one_line
from erase_tune.measure import provenance, qps_summary, ratio_spread, time_interleaved
from erase_tune.measure.stats import gain
from erase_tune.runtime import EraseEngine, ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.runtime.losscheck import check_loss
from erase_tune.workloads import Workload, WorkloadData
from erase_tune.workloads.limits import MAX_SEED

__all__ = ["Budget", "VariantResult", "TrialResult", "TrialFailed", "run_trial", "build_engine", "Variant", "jsonable_args",
           "release", "reference_capture_error", "UNKNOWN", "BASELINE"]
__all__ += ["check_workload_loss", "MAX_REPEATS"]

GRAPH_WARMUP = 3
"""Eager steps an engine runs before capturing a CUDA graph (capture happens on the next)."""
MAX_STEPS = 1_000_000
"""Largest step count of any budget field: a trial is minutes, not weeks."""
MAX_REPEATS = 100
"""Largest noise_repeats, quality_scale and quality_seeds."""
_REPEATS = ("noise_repeats", "quality_scale", "quality_seeds")
BASELINE = "baseline"
"""The variant every trial of a workload shares: a failure that names it fails every trial."""


class _Unknown:
    """Type of :data:`UNKNOWN`."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()
"""``run_trial(reference_error=UNKNOWN)``: not tried yet; the trial tries the capture itself."""


class TrialFailed(EraseTuneError, RuntimeError):
    """The trial ran but produced no usable measurement (NaN loss, capture failure, ...)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget:
    """How long a trial trains and times each variant."""

    warmup_steps: int = 8
    """Untimed steps per variant first (covers graph warm-up and capture)."""
    windows: int = 4
    """Alternating timing rounds; each variant runs one window per round."""
    window_steps: int = 10
    """Timed steps per window."""
    quality_steps: int = 0
    """Extra untimed training steps for baseline and candidate before NE is measured."""
    seed: int = 0
    """Seed for weights and data order."""
    reference: bool = True
    """Also time the whole-step-graph baseline (the honest competitor; CUDA only)."""
    detach_only: bool = True
    """Also time the candidate's detach-only twin (splits work removed from overlap gained)."""
    # The three fields below are read by the service around the trials, never by a trial.
    noise_repeats: int = 3
    """Data orders the noise floor of the NE gap is measured over (erase_tune.noise; 0: none)."""
    quality_scale: int = 4
    """Quality confirmation trains finalists this many times a trial's training steps (0: none)."""
    quality_seeds: int = 3
    """Seeds (data orders) of the quality confirmation; its NE gap interval is over these."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "windows", "window_steps", "quality_steps", "seed", "noise_repeats",
                     "quality_scale", "quality_seeds"):
            value = getattr(self, name)
            top = MAX_SEED if name == "seed" else MAX_REPEATS if name in _REPEATS else MAX_STEPS
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                shown = "a huge integer" if isinstance(value, int) and abs(value) > 10**12 else repr(value)
                raise EraseTuneError(f"budget.{name}: {shown} must be an integer in 0..{top}")
        if self.warmup_steps < GRAPH_WARMUP + 2:
            raise EraseTuneError(
                f"budget.warmup_steps: {self.warmup_steps} is too short; CUDA graphs need {GRAPH_WARMUP + 2} "
                "(eager warm-up, capture, one replay) before timing starts"
            )
        if self.windows < 1 or self.window_steps < 1:
            raise EraseTuneError("budget.windows and budget.window_steps must be >= 1")
        if self.quality_scale and not self.quality_seeds:
            raise EraseTuneError("budget.quality_seeds: must be >= 1 when budget.quality_scale is set (0 turns "
                                 "quality confirmation off)")

    @property
    def training_steps(self) -> int:
        """Steps baseline and candidate have trained for when NE is measured."""
        return self.warmup_steps + self.windows * self.window_steps + self.quality_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantResult:
    """Timing of one variant: summary and raw per-step samples."""

    name: str
    plan: str
    p90_qps: float
    median_qps: float
    steps_s: tuple[float, ...]
    window: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialResult:
    """Everything one trial measured, with provenance."""

    workload: str
    plan: ErasePlan
    batch_size: int
    variants: Mapping[str, VariantResult]
    """``baseline``, ``candidate`` and, where run, ``detach_only`` and ``reference``."""
    ne_baseline: float
    ne_candidate: float
    ne_gap: float
    gain_p90: float
    """Candidate over baseline, p90 of per-step QPS (the paper's headline statistic)."""
    gain_median: float
    gain_spread: tuple[float, float]
    """Lowest and highest per-window median-QPS gain over baseline."""
    gain_vs_reference: float | None
    """Candidate over the whole-step-graph baseline (p90), where that ran."""
    gain_detach_only: float | None
    """Detach-only twin over baseline (p90): the part of the gain that is work removed."""
    duration_s: float
    provenance: Mapping[str, Any]
    reference_error: str | None = None
    """Why the whole-step-graph reference was left out (its capture failed), in one line; None
    when it ran or was not asked for."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, raw samples included."""
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        out["variants"] = {k: dataclasses.asdict(v) for k, v in self.variants.items()}
        out["provenance"] = dict(self.provenance)
        return out

    def metrics(self) -> dict[str, float | None]:
        """The flat numbers a study records (no samples)."""
        out: dict[str, float | None] = {
            "gain_p90": self.gain_p90,
            "gain_median": self.gain_median,
            "gain_lo": self.gain_spread[0],
            "gain_hi": self.gain_spread[1],
            "gain_vs_reference": self.gain_vs_reference,
            "gain_detach_only": self.gain_detach_only,
            "ne_baseline": self.ne_baseline,
            "ne_candidate": self.ne_candidate,
            "ne_gap": self.ne_gap,
        }
        for name, v in self.variants.items():
            out[f"{name}_p90_qps"] = v.p90_qps
            out[f"{name}_median_qps"] = v.median_qps
        return out


@dataclasses.dataclass
class Variant:
    """A model trained under one plan, ready to step through the workload's batches."""

    plan: ErasePlan
    engine: EraseEngine
    data: WorkloadData
    last_loss: torch.Tensor | None = None
    rank: int = 0
    world: int = 1
    """Data parallel: this rank trains step ``s`` on batch ``s·world + rank``."""

    def __call__(self, step: int) -> None:
        inputs, target = self.data.batch(step * self.world + self.rank)
        self.last_loss = self.engine.step(inputs, target)


def build_engine(workload: Workload, plan: ErasePlan, init: torch.nn.Module, data: WorkloadData,
                 device: torch.device, process_group: Any = None) -> EraseEngine:
    """A copy of the initial model ``init`` on ``device``, trained under ``plan`` (data parallel
    across ``process_group`` when one is given)."""
    model = copy.deepcopy(init).to(device)
    return EraseEngine(
        model,
        plan,
        loss_fn=workload.loss_fn,
        optimizer=workload.optimizer,
        example=data.batch(0),
        make_head=workload.make_head,
        graph_warmup=GRAPH_WARMUP,
        process_group=process_group,
        output=workload.output,
        model_loss=workload.model_loss,
    )


def ranks_of(process_group: Any) -> tuple[int, int]:
    """(rank, world size) in ``process_group``; (0, 1) without one."""
    if process_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(process_group), dist.get_world_size(process_group)


def run_trial(
    workload: Workload,
    plan: ErasePlan,
    budget: Budget = Budget(),
    device: str | torch.device | None = None,
    *,
    baseline_ne: float | None = None,
    process_group: Any = None,
    reference_error: str | None | _Unknown = UNKNOWN,
) -> TrialResult:
    """Measure ``plan`` on ``workload`` against the baseline; see the module docstring.

    ``baseline_ne``: the baseline's held-out NE from an earlier trial of the same workload,
    budget, seed and device (the service caches it); the baseline is then still timed but
    not trained on for quality, which saves those steps. ``process_group``: run as one rank of
    a data-parallel trial (see the module docstring); every rank of the group must call this
    with the same arguments. ``reference_error``: what :func:`reference_capture_error` said for
    this workload and device (the service tries it once per job): None, the reference runs; a
    reason, it is left out and the reason recorded. Left :data:`UNKNOWN`, the trial tries the
    capture itself first (only when ``budget.reference`` and on CUDA).
    """
    started = time.perf_counter()
    device = resolve_device(device)
    with_reference = budget.reference and device.type == "cuda"
    if isinstance(reference_error, _Unknown):
        ref_error = reference_capture_error(workload, device, seed=budget.seed) if with_reference else None
    else:
        ref_error = reference_error
    torch.manual_seed(budget.seed)
    data = workload.make_data(device)
    init = workload.build_model()
    plan.check_model(init)
    rank, world = ranks_of(process_group)

    plans: dict[str, ErasePlan] = {"baseline": ErasePlan(), "candidate": plan}
    if budget.detach_only and plan.cuts:
        plans["detach_only"] = plan.detach_only()
    if with_reference and ref_error is None:
        plans["reference"] = ErasePlan(whole_step_graph=True)
    variants: dict[str, Variant] = {}
    try:
        for name, p in plans.items():
            variants[name] = Variant(plan=p, engine=build_engine(workload, p, init, data, device, process_group),
                                     data=data, rank=rank, world=world)
            if name == "baseline":  # before any cut's aux head is sized: a bad loss is the loss's fault
                check_workload_loss(workload, variants[name].engine.model, data)
        timings = time_interleaved(
            variants, device=device, warmup_steps=budget.warmup_steps,
            windows=budget.windows, window_steps=budget.window_steps,
        )
        for name, v in variants.items():
            _check_finite(name, v, process_group)
        step = timings.next_step
        quality = ("candidate",) if baseline_ne is not None else ("baseline", "candidate")
        for _ in range(budget.quality_steps):
            for name in quality:
                variants[name](step)
            step += 1
        ne = {"baseline": baseline_ne}
        for name in quality:
            _check_finite(name, variants[name], process_group)
            ne[name] = workload.normalized_entropy(variants[name].engine.model, data)
            if not math.isfinite(ne[name]):
                raise TrialFailed(f"{name}: held-out NE is {ne[name]}")
    finally:
        release(variants.values(), device)
        variants.clear()

    batch = workload.batch_size * world  # all ranks' examples per step
    results = {}
    for name, t in timings.variants.items():
        s = qps_summary(t.steps_s, batch)
        results[name] = VariantResult(name=name, plan=plans[name].describe(), p90_qps=s.p90, median_qps=s.median,
                                      steps_s=t.steps_s, window=t.window)
    spread = ratio_spread(timings.variants["candidate"], timings.variants["baseline"], batch)
    cand = results["candidate"]
    return TrialResult(
        workload=workload.name,
        plan=plan,
        batch_size=batch,
        variants=results,
        ne_baseline=ne["baseline"],
        ne_candidate=ne["candidate"],
        ne_gap=(ne["candidate"] - ne["baseline"]) / ne["baseline"],
        gain_p90=gain(cand.p90_qps, results["baseline"].p90_qps),
        gain_median=gain(cand.median_qps, results["baseline"].median_qps),
        gain_spread=(spread.lo - 1.0, spread.hi - 1.0),
        gain_vs_reference=gain(cand.p90_qps, results["reference"].p90_qps) if "reference" in results else None,
        gain_detach_only=gain(results["detach_only"].p90_qps, results["baseline"].p90_qps) if "detach_only" in results else None,
        duration_s=time.perf_counter() - started,
        provenance=provenance(
            device, workload=workload.name, workload_args=jsonable_args(workload.args),
            budget=dataclasses.asdict(budget), training_steps=budget.training_steps,
            baseline_ne_cached=baseline_ne is not None, ranks=world,
            # > 1 means batches were re-read; a CTR proxy over-fits on a second pass, so NE is then suspect.
            data_passes=round(budget.training_steps * world / len(data.train), 3),
        ),
        reference_error=ref_error,
    )


def check_workload_loss(workload: Workload, model: torch.nn.Module, data: WorkloadData) -> None:
    """The workload's loss on ``model``'s output for the first training batch: a scalar, a mean
    over the batch, and accepted (erase_tune.runtime.losscheck); one line naming the mistake."""
    inputs, target = data.batch(0)
    try:
        check_loss(model, tuple(inputs), target, workload.loss_fn, output=workload.output)
    except EraseTuneError as e:
        raise EraseTuneError(f"workload {workload.name}: {e}") from None


def reference_capture_error(workload: Workload, device: str | torch.device | None = None, *,
                            seed: int = 0) -> str | None:
    """Try the whole-step CUDA-graph reference once: None when it captures and replays, else why
    not (the :class:`~erase_tune.errors.CaptureError`'s line). None on the CPU (no graph there).

    A copy of the workload's model is trained under ``ErasePlan(whole_step_graph=True)`` for
    the engine's warm-up, the capture and one replay, on the workload's own batches. Run it
    before anything else in the process: a failed capture can leave the process's CUDA RNG in
    capture state (see :class:`~erase_tune.errors.CaptureError`), so it is repaired here and
    checked with one draw; if it cannot be, :class:`TrialFailed` says so (run the trial again
    in a fresh process with the reference off). Other errors (the workload's own) propagate.
    """
    device = resolve_device(device)
    if device.type != "cuda":
        return None
    torch.manual_seed(seed)
    data = workload.make_data(device)
    init = workload.build_model()
    engine: EraseEngine | None = None
    error: str | None = None
    try:
        engine = build_engine(workload, ErasePlan(whole_step_graph=True), init, data, device)
        for step in range(GRAPH_WARMUP + 2):  # eager warm-up, capture, one replay
            inputs, target = data.batch(step)
            loss = engine.step(inputs, target)
        torch.cuda.synchronize(device)
        del loss
    except CaptureError as e:
        error = one_line(" ".join(str(e).split()), 400)
    finally:
        if engine is not None:
            engine.close()
        del engine, init, data
        release((), device)
    if error is not None:
        _restore_cuda_rng(device, error)
    return error


def _restore_cuda_rng(device: torch.device, error: str) -> None:
    """After a failed capture: give the device's default generator a fresh state (same seed)
    if the failed capture left it in capture state, and check it with one draw. Seen on an H200
    (torch 2.11): a capture invalidated by a CPU sync leaves the generator capturing (the next
    draw fails with "Offset increment outside graph capture"), and a fresh state set this way
    draws again; a capture refused by torch itself (a host-to-device copy) leaves it untouched."""
    try:
        torch.randn(1, device=device)
        return
    except RuntimeError:
        pass
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    try:
        seed = gen.initial_seed()
        gen.graphsafe_set_state(torch.Generator(device=device))
        gen.manual_seed(seed)
        torch.randn(1, device=device)
    except RuntimeError as e:
        raise TrialFailed(f"the whole-step CUDA graph cannot be captured ({error}), and the failed capture left this "
                          f"process's CUDA RNG unusable ({one_line(str(e).splitlines()[0] if str(e) else '', 200)}): "
                          "run again with the reference off") from None


def release(runners: Iterable[object], device: torch.device) -> None:
    """Close the engines among ``runners`` and hand their memory back (trials run back to back)."""
    for r in runners:
        if isinstance(r, Variant):
            r.engine.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _check_finite(name: str, variant: Variant, process_group: Any = None) -> None:
    bad = variant.last_loss is not None and not bool(torch.isfinite(variant.last_loss))
    if process_group is not None:  # every rank fails together, or none does (no rank left waiting)
        import torch.distributed as dist

        device = variant.last_loss.device if variant.last_loss is not None else torch.device("cpu")
        flag = torch.tensor([float(bad)], device=device)
        dist.all_reduce(flag, group=process_group)
        if flag.item() and not bad:
            raise TrialFailed(f"{name}: training loss became non-finite on another rank ({variant.plan.describe()})")
    if bad:
        raise TrialFailed(f"{name}: training loss became {float(variant.last_loss)} ({variant.plan.describe()})")


def jsonable_args(args: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in args.items()}
