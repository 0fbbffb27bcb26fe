"""One trial: a candidate plan against the baseline, measured side by side in one process.

The numbers users act on come from here, so the protocol follows the measurement
rules of docs/design.md: baseline (no cuts), candidate, its "detach only" twin (same cuts, no early launch)
and the best non-detached reference (whole-step CUDA graph, no cuts; CUDA only) all start
from the same weights, see the same batches, and are timed on the device in alternating
windows after warm-up, by the one sequential protocol (:func:`erase_tune.measure.measure_gains`):
at least ``budget.windows`` rounds, then on until the candidate's gain over the ``gain_over``
baseline has a 95% interval of at most ``±budget.halfwidth``, its upper bound falls below
``stop_below`` (racing: it cannot reach the study's front), or ``budget.max_windows``. The
twin, the reference and the baseline run as long as the candidate does. The gain a study ranks
by is the mean of the per-window gains (window-median QPS ratios), with its interval; the
paper's p90 of pooled per-step QPS and the median are reported beside it.

Quality is held-out NE of baseline and candidate after the same ``budget.training_steps``
(the quality phase trains on where the timing stopped); the NE gap is
``(NE_cand - NE_base) / NE_base``. A plan that changes no gradient (:func:`exact_by_construction`:
placements, graphed pieces, the whole-step graph, the empty plan) pays for speed only: its
gradients of one step after the warm-up (which covers graph capture and a replay) are compared
with the baseline's, both taking that step from the same weights on the same batch, and when
they agree (:func:`gradient_difference`) it is recorded exact, NE gap 0, and trained no further.
One that disagrees is measured for NE like a plan with cuts.

With ``process_group`` (a trial of k ranks): every rank runs the same protocol, every variant
(baseline included) averages its gradients across the group (:class:`EraseEngine`'s
``process_group``), rank r trains step s on batch ``s·k + r`` (each rank a full ``batch``: the
workload's batch is per rank), and QPS counts all ranks' examples (k·batch per step, timed on
this rank; the step's collectives keep the ranks in step). Every rank acts on rank 0's window
gains, so all stop timing at the same round; every rank returns the same NE; the service keeps
rank 0's result.

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
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from erase_tune.errors import CaptureError, EraseTuneError, one_line, shown
from erase_tune.measure import (
    GainEstimate,
    ProtocolHooks,
    ProtocolResult,
    measure_gains,
    provenance,
    qps_summary,
)
from erase_tune.measure.records import (  # the records a trial takes and returns, re-exported here
    GAIN_OVER,
    GRAPH_WARMUP,
    MAX_REPEATS,
    Budget,
    TrialResult,
    VariantResult,
)
from erase_tune.measure.rng import SeededRandom, global_state, set_global_state
from erase_tune.measure.stats import gain
from erase_tune.runtime import EraseEngine, ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.runtime.losscheck import check_loss
from erase_tune.workloads import Workload, WorkloadData

log = logging.getLogger("erase_tune.measure")

__all__ = ["Budget", "Ranking", "VariantResult", "TrialResult", "TrialFailed", "run_trial", "build_engine", "Variant",
           "jsonable_args",
           "release", "reference_capture_error", "capture_error", "UNKNOWN", "BASELINE"]
__all__ += ["task_gaps", "check_workload_loss", "MAX_REPEATS", "GAIN_OVER", "exact_by_construction", "gradient_difference",
            "agree_with_rank0", "EXACT_RTOL", "prepare"]

BASELINE = "baseline"
"""The variant every trial of a workload shares: a failure that names it fails every trial."""
EXACT_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
"""How far a gradient of a plan exact by construction may be from the baseline's, relative to the
gradient's largest magnitude, by the gradient's dtype (other dtypes: bitwise). The same
mathematics gives the same bits when the same kernels run in the same order (the CPU, eager
placements); it need not when they do not: a graphed piece or the whole-step graph launches
other kernels (and its capturable optimizer leaves weights an ulp apart after a step), an
embedding's backward accumulates with atomics. That costs a few ulps per element, relayed
through a few steps: float32's ulp is 1.2e-7 (1e-5 is ~80 of them), float64's 2.2e-16, bf16's
7.8e-3 and fp16's 9.8e-4 (1e-2: about one). A cut removes whole terms of a gradient, which
moves it by far more. A model computing in bf16 under autocast keeps float32 parameters and
gradients and is held to float32's tolerance: a graphed variant of it that misses it is measured
for NE like a plan with cuts (slower, never wrong)."""


class _Unknown:
    """Type of :data:`UNKNOWN`."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()
"""``run_trial(reference_error=UNKNOWN)``: not tried yet; the trial tries the capture itself."""


class TrialFailed(EraseTuneError, RuntimeError):
    """The trial ran but produced no usable measurement (NaN loss, capture failure, ...)."""


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
    random: SeededRandom | None = None
    """The random numbers its steps draw (dropout masks): the variants a trial compares each
    draw their own copy of one seed's, so they draw alike however they are interleaved. None:
    torch's global generators as they are."""

    def __call__(self, step: int) -> None:
        inputs, target = self.data.batch(step * self.world + self.rank)
        if self.random is None:
            self.last_loss = self.engine.step(inputs, target)
            return
        with self.random.drawing():
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


_PREPARED: dict[str, Any] = {}
"""The last workload :func:`prepare` built in this process (a trial worker runs one job's trials
one after another: same workload, same seed)."""


def _code(f: Any) -> Any:
    """What makes a factory the same one across calls: its code (a workload made anew per trial
    makes new closures over the same code), else the object itself."""
    f = getattr(f, "func", f)  # functools.partial
    return getattr(f, "__code__", None) or id(f)


def prepare(workload: Workload, device: torch.device, seed: int) -> tuple[WorkloadData, torch.nn.Module]:
    """The workload's data on ``device`` and its initial model, made after ``torch.manual_seed(seed)``
    and left with the random state they leave: the same every time. The last one is kept for the
    next call with the same workload, arguments, seed and device (a large model's initialisation
    and its data took most of a reference-DLRM trial's 15 s on an H200), with its random state
    restored, so a later trial starts exactly as the first did. Nothing reads back into them:
    every variant trains a copy of the model. A workload with ``reuse_data`` off is built anew."""
    key = repr((workload.name, sorted(jsonable_args(workload.args).items()), seed, str(device),
                _code(workload.build_model), _code(workload.make_data)))
    hit = workload.reuse_data and _PREPARED.get("key") == key
    if hit:
        data, init, rng = _PREPARED["value"]
        set_global_state(device, rng)
        return data, init
    _PREPARED.clear()  # the old one goes before the new one is made (a large model and its data twice may not fit)
    torch.manual_seed(seed)
    data = workload.make_data(device)
    init = workload.build_model()
    if workload.reuse_data:
        _PREPARED.update(key=key, value=(data, init, global_state(device)))
    return data, init


def ranks_of(process_group: Any) -> tuple[int, int]:
    """(rank, world size) in ``process_group``; (0, 1) without one."""
    if process_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(process_group), dist.get_world_size(process_group)


def exact_by_construction(plan: ErasePlan) -> bool:
    """A plan with no cuts detaches nothing: placements and graphed pieces keep every gradient,
    so its training is the baseline's mathematics and any NE gap it measures is noise."""
    return not plan.cuts


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ranking:
    """Which gain a trial stops timing on and reports as ``TrialResult.gain``, and its race bound
    (both checked by :func:`run_trial`)."""

    gain_over: str = "eager"
    """``eager`` (over the baseline) or ``graph`` (over the whole-step-graph reference, which must run)."""
    stop_below: float | None = None
    """The racing bound: timing stops once the gain's upper bound is below it (None: no race)."""


def run_trial(
    workload: Workload,
    plan: ErasePlan,
    budget: Budget = Budget(),
    device: str | torch.device | None = None,
    *,
    baseline_ne: float | None = None,
    process_group: Any = None,
    reference_error: str | None | _Unknown = UNKNOWN,
    ranking: Ranking = Ranking(),
) -> TrialResult:
    """Measure ``plan`` on ``workload`` against the baseline; see the module docstring.

    ``baseline_ne``: the baseline's held-out NE from an earlier trial of the same workload,
    budget, seed and device (the service caches it); the baseline is then still timed but
    not trained on for quality, which saves those steps. ``process_group``: run as one rank of
    a data-parallel trial (see the module docstring); every rank of the group must call this
    with the same arguments. ``reference_error``: what :func:`reference_capture_error` said for
    this workload and device (the service tries it once per job): None, the reference runs; a
    reason, it is left out and the reason recorded. Left :data:`UNKNOWN`, the trial tries the
    capture itself first (only when ``budget.reference`` and on CUDA). ``ranking.gain_over``:
    which gain's interval decides when timing stops, and which one ``TrialResult.gain`` is:
    ``eager`` (over the baseline) or ``graph`` (over the whole-step-graph reference, which must
    run). ``ranking.stop_below``: the racing bound: timing stops once the gain's upper bound is
    below it."""
    started = time.perf_counter()
    gain_over, stop_below = ranking.gain_over, ranking.stop_below
    device = resolve_device(device)
    with_reference = _check_trial_options(budget, device, gain_over, stop_below)
    ref_error = _reference_error(workload, budget, device, with_reference, reference_error, gain_over)
    baseline_ne = None if len(workload.tasks) > 1 else baseline_ne  # a cached NE is only the main task's
    data, init = prepare(workload, device, budget.seed)
    plan.check_model(init)
    world = ranks_of(process_group)[1]
    plans, pairs = _variant_plans(plan, budget, with_reference and ref_error is None, gain_over)
    variants: dict[str, Variant] = {}
    check = _ExactnessCheck(workload, budget, init, data, device, process_group, variants)
    try:
        _build_variants(variants, workload, plans, init, data, device, budget.seed, process_group)
        measured = _time_variants(variants, budget, device, pairs, stop_below,
                                  check if exact_by_construction(plan) else None, process_group)
        exact = bool(check.ok)
        ne: dict[str, float | None] = {"baseline": baseline_ne, "candidate": baseline_ne}
        per_task: dict[str, dict[str, float]] = {}  # each task's NE, by variant
        if not exact:
            quality = ("candidate",) if baseline_ne is not None else ("baseline", "candidate")
            ne.update(_train_for_quality(workload, {n: variants[n] for n in quality}, measured,
                                         budget.training_steps, process_group, per_task))
    finally:
        release(variants.values(), device)
        variants.clear()
    trained = budget.training_steps if not exact else measured.next_steps["candidate"] + 1  # (+ the check's step)
    passes = round(trained * world / len(data.train), 3)  # > 1: batches were re-read (NE is then suspect)
    return TrialResult(
        workload=workload.name, plan=plan, batch_size=workload.batch_size * world, exact=exact, exact_diff=check.diff,
        reference_error=ref_error, **_measured_fields(measured, plans, workload.batch_size * world),
        **_quality_fields(workload, ne, per_task, exact), data_note=_passes_note(passes, workload.args),
        duration_s=time.perf_counter() - started, provenance=_trial_provenance(
            workload, budget, device, world, trained, gain_over=gain_over, stop_below=stop_below,
            baseline_ne_cached=baseline_ne is not None, data_passes=passes))


def _trial_provenance(workload: Workload, budget: Budget, device: torch.device, world: int, trained: int,
                      **settings: Any) -> dict[str, Any]:
    """A trial's provenance: the machine's, the workload, the budget, the steps trained and the
    trial's ``settings``."""
    return provenance(
        device, workload=workload.name, workload_args=jsonable_args(workload.args),
        budget=dataclasses.asdict(budget), training_steps=trained, **settings, ranks=world,
        **({"main_task": workload.main.name} if workload.main is not None else {}),
    )


def _passes_note(passes: float, args: Mapping[str, Any]) -> str | None:
    """What reading the training batches ``passes`` times (above 1) means, one phrase with the
    remedy in the words of the workload's ``args`` (None when each batch was read at most once:
    a CTR proxy over-fits on a second pass, so NE is then suspect)."""
    if passes <= 1:
        return None
    more = ("raise the workload's train_batches" if "train_batches" in args  # the built-ins
            else "give the workload more training batches than the trial takes steps")
    return (f"training read its batches {passes:.1f} times ({more} for one pass; a second pass can over-fit "
            "and skew NE)")


def _time_variants(variants: Mapping[str, Variant], budget: Budget, device: torch.device,
                   pairs: Mapping[str, tuple[str, ...]], stop_below: float | None,
                   after_warmup: Callable[[], None] | None, process_group: Any) -> ProtocolResult:
    """The variants timed by the one protocol until the candidate's gain is known well enough
    (every rank acting on rank 0's gains), then checked for a finite training loss."""
    measured = measure_gains(
        variants, device=device, steps=budget.steps(), rule=budget.stop_rule(below=stop_below), pairs=pairs,
        deciding=("candidate",),
        hooks=ProtocolHooks(after_warmup=after_warmup,
                            agree=agree_with_rank0(device, process_group) if process_group is not None else None),
    )
    for name, v in variants.items():
        _check_finite(name, v, process_group)
    return measured


def _build_variants(into: dict[str, Variant], workload: Workload, plans: Mapping[str, ErasePlan],
                    init: torch.nn.Module, data: WorkloadData, device: torch.device, seed: int,
                    process_group: Any) -> None:
    """One :class:`Variant` per plan, put in ``into`` as each is built (so that a failure
    releases the ones built before it), every one drawing its own copy of ``seed``'s random numbers."""
    rank, world = ranks_of(process_group)
    for name, p in plans.items():
        into[name] = Variant(plan=p, engine=build_engine(workload, p, init, data, device, process_group),
                             data=data, rank=rank, world=world, random=SeededRandom(device, seed))
        if name == "baseline":  # before any cut's aux head is sized: a bad loss is the loss's fault
            check_workload_loss(workload, into[name].engine.model, data)


def _check_trial_options(budget: Budget, device: torch.device, gain_over: str, stop_below: float | None) -> bool:
    """``run_trial``'s ``gain_over`` and ``stop_below`` checked; whether the whole-step-graph
    reference is to run (asked for, and on CUDA)."""
    if gain_over not in GAIN_OVER:
        raise EraseTuneError(f"gain_over: {shown(gain_over)} is not one of {', '.join(GAIN_OVER)}")
    if stop_below is not None and (isinstance(stop_below, bool) or not isinstance(stop_below, (int, float))
                                   or not math.isfinite(stop_below)):
        raise EraseTuneError(f"stop_below: {shown(stop_below)} must be a finite gain or None")
    with_reference = budget.reference and device.type == "cuda"
    if gain_over == "graph" and not with_reference:
        why = "budget.reference is off" if not budget.reference else f"it needs CUDA, not {device.type}"
        raise EraseTuneError(f"gain_over: graph needs the whole-step-graph reference, which does not run here ({why})")
    return with_reference


def _reference_error(workload: Workload, budget: Budget, device: torch.device, with_reference: bool,
                     reference_error: str | None | _Unknown, gain_over: str) -> str | None:
    """Why the whole-step-graph reference is left out (None: it runs, or was not asked for),
    tried here when the caller does not know yet."""
    if isinstance(reference_error, _Unknown):
        ref_error = reference_capture_error(workload, device, seed=budget.seed) if with_reference else None
    else:
        ref_error = reference_error
    if gain_over == "graph" and ref_error is not None:
        raise EraseTuneError("gain_over: graph needs the whole-step-graph reference, which cannot be captured for "
                             f"this workload ({ref_error}): use gain_over: eager")
    return ref_error


def _variant_plans(plan: ErasePlan, budget: Budget, reference: bool,
                   gain_over: str) -> tuple[dict[str, ErasePlan], dict[str, tuple[str, ...]]]:
    """The variants a trial times (by name) and the pairs its gains are over."""
    plans: dict[str, ErasePlan] = {"baseline": ErasePlan(), "candidate": plan}
    if budget.detach_only and plan.cuts:
        plans["detach_only"] = plan.detach_only()
    if reference:
        plans["reference"] = ErasePlan(whole_step_graph=True)
    over = ("baseline",) if "reference" not in plans else ("baseline", "reference")
    pairs: dict[str, tuple[str, ...]] = {"candidate": over if gain_over == "eager" else over[::-1]}
    if "detach_only" in plans:
        pairs["detach_only"] = ("baseline",)
    return plans, pairs


class _ExactnessCheck:
    """After the warm-up (graphs captured and replayed): one more step of the baseline and the
    candidate from the same weights, and that step's gradients compared.

    The candidate's parameters and buffers are set (in place: captured graphs keep their
    addresses) to the baseline's, then both take the next step on the same batch, each drawing
    its own random numbers (a plan that shifts the dropout masks differs here). Eight steps of
    training apart, two runs of one plan already differ by percents where a backward is not
    deterministic; from the same weights they differ only by rounding. Where the gradients
    differ beyond the dtype's tolerance, a twin of the baseline takes the same step from the
    same weights and random state, and the candidate may differ from the baseline as far as the
    baseline differs from itself (a backward with atomics). Both runs then train on from there.
    ``diff`` and ``ok`` are None until it ran."""

    def __init__(self, workload: Workload, budget: Budget, init: torch.nn.Module, data: WorkloadData,
                 device: torch.device, process_group: Any, variants: Mapping[str, Variant]) -> None:
        self.workload, self.budget, self.init, self.data = workload, budget, init, data
        self.device, self.process_group, self.variants = device, process_group, variants
        self.diff: float | None = None
        self.ok: bool | None = None

    def __call__(self) -> None:
        base_v, cand_v = self.variants["baseline"], self.variants["candidate"]
        cand, base = cand_v.engine.model, base_v.engine.model
        step = self.budget.warmup_steps  # the check step's batch: the one after the warm-up
        start = _weights(base)
        random_state = base_v.random.state if base_v.random is not None else None
        _load_weights(cand, start)
        base_v(step)
        cand_v(step)
        diff, ok = gradient_difference(cand, base)
        if not ok and self.process_group is None:  # (several ranks would have to agree to build the twin)
            noise = self._baseline_noise(base, start, random_state, step)
            if noise is not None:
                diff, ok = gradient_difference(cand, base, noise)
        if self.process_group is not None:  # every rank decides the same (rank-local kernels may differ)
            diff, ok = _agree_worst(diff, ok, self.device, self.process_group)
        self.diff, self.ok = diff, ok

    def _baseline_noise(self, base: torch.nn.Module, start: list[torch.Tensor], random_state: Any,
                        step: int) -> list[float] | None:
        """Per parameter, how far a twin of the baseline, taking the check step from the same
        weights and random state, is from it."""
        random = SeededRandom(self.device, self.budget.seed)
        if random_state is not None:
            random.state = random_state
        twin = Variant(plan=ErasePlan(), engine=build_engine(self.workload, ErasePlan(), self.init, self.data,
                                                             self.device), data=self.data, random=random)
        try:
            _load_weights(twin.engine.model, start)
            twin(step)
            noise = gradient_differences(twin.engine.model, base, norm="l2")
            return None if noise is None else [n for n, _ in noise]
        finally:
            release([twin], self.device)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """A copy of ``model``'s parameters and buffers, in registration order."""
    with torch.no_grad():
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _load_weights(model: torch.nn.Module, weights: Sequence[torch.Tensor]) -> None:
    """``weights`` (from :func:`_weights` of the same model under another plan) copied in place."""
    own = [*model.parameters(), *model.buffers()]
    if len(own) != len(weights) or any(a.shape != b.shape for a, b in zip(own, weights)):
        return  # not the same model: the gradient comparison says so
    with torch.no_grad():
        for a, b in zip(own, weights):
            a.copy_(b)


def _train_for_quality(workload: Workload, variants: Mapping[str, Variant], measured: ProtocolResult,
                       training_steps: int, process_group: Any,
                       per_task: dict[str, dict[str, float]]) -> dict[str, float]:
    """``variants`` (the candidate, and the baseline unless its NE is cached) trained on to
    ``training_steps`` from where their timing stopped, and their held-out NE (the main task's;
    each task's into ``per_task``, by variant)."""
    quality = list(variants)
    # On to the same training length whatever the timing ran: NE compares across trials.
    first = min(measured.next_steps[n] for n in quality)
    if training_steps > first:  # --quality-steps 1000000 is hours: say what runs
        log.info(f"training {', '.join(quality)} on to step {training_steps:,} for held-out NE; Ctrl-C stops")
    for step in range(first, training_steps):
        for name in quality:
            if step >= measured.next_steps[name]:
                variants[name](step)
    ne: dict[str, float] = {}
    for name in quality:
        _check_finite(name, variants[name], process_group)
        per_task[name] = workload.normalized_entropies(variants[name].engine.model, variants[name].data)
        value = per_task[name][workload.main.name] if workload.main else per_task[name][workload.name]
        if not math.isfinite(value):
            raise TrialFailed(f"{name}: held-out NE is {value}")
        ne[name] = value
    return ne


def _quality_fields(workload: Workload, ne: Mapping[str, float | None], per_task: Mapping[str, Mapping[str, float]],
                    exact: bool) -> dict[str, Any]:
    """The NE fields of a :class:`TrialResult` (the main task's, and each task's: :func:`task_gaps`)."""
    if exact:
        ne_gap = 0.0
    else:
        assert ne["candidate"] is not None and ne["baseline"] is not None
        ne_gap = (ne["candidate"] - ne["baseline"]) / ne["baseline"]
    return {"ne_baseline": ne["baseline"], "ne_candidate": ne["candidate"], "ne_gap": ne_gap,
            "ne_tasks": task_gaps(workload, ne, per_task, exact)}


def _measured_fields(measured: ProtocolResult, plans: Mapping[str, ErasePlan], batch: int) -> dict[str, Any]:
    """The timing fields of a :class:`TrialResult`: every variant's QPS and the gains
    (``batch``: all ranks' examples per step)."""
    results = {}
    for name, t in measured.timings.variants.items():
        s = qps_summary(t.steps_s, batch)
        results[name] = VariantResult(name=name, plan=plans[name].describe(), p90_qps=s.p90, median_qps=s.median,
                                      steps_s=t.steps_s, window=t.window)
    primary = measured.gains["candidate"]
    eager = measured.vs("candidate", "baseline")
    cand, base = results["candidate"], results["baseline"]
    return dict(
        variants=results,
        gain=primary.gain, gain_lo=primary.lo, gain_hi=primary.hi, windows=primary.windows, stopped=primary.stopped,
        gain_p90=gain(cand.p90_qps, base.p90_qps),
        gain_median=gain(cand.median_qps, base.median_qps),
        gain_spread=(min(eager.per_window), max(eager.per_window)),
        gain_vs_reference=gain(cand.p90_qps, results["reference"].p90_qps) if "reference" in results else None,
        gain_vs_reference_interval=(_interval(measured.vs("candidate", "reference")) if "reference" in plans
                                    else None),
        gain_detach_only=(gain(results["detach_only"].p90_qps, base.p90_qps) if "detach_only" in results else None),
    )


def task_gaps(workload: Workload, ne: Mapping[str, float | None], per_task: Mapping[str, Mapping[str, float]],
              exact: bool) -> dict[str, dict[str, float | None]] | None:
    """``TrialResult.ne_tasks``: each task's NE under the baseline and the candidate, and its gap
    (0 for a plan verified exact); the main task's baseline is ``ne``'s where it was cached."""
    if not workload.tasks or workload.main is None:
        return None
    out: dict[str, dict[str, float | None]] = {}
    for task in workload.tasks:
        main = task.name == workload.main.name
        base = per_task.get("baseline", {}).get(task.name, ne["baseline"] if main else None)
        cand = base if exact else per_task.get("candidate", {}).get(task.name)
        gap = 0.0 if exact else (None if base is None or cand is None else (cand - base) / base)
        out[task.name] = {"baseline": base, "candidate": cand, "gap": gap}
    return out


def gradient_difference(model: torch.nn.Module, reference: torch.nn.Module,
                        noise: Sequence[float] | None = None) -> tuple[float, bool]:
    """``(largest relative difference, within tolerance)`` between the ``.grad`` of ``model``'s
    parameters and ``reference``'s, parameter by parameter in registration order (the same model
    under two plans).

    Without ``noise``, each difference is ``max|a - b| / max(max|a|, max|b|)``, and within
    tolerance means bitwise equal or at most :data:`EXACT_RTOL` of the gradient's dtype. With
    ``noise`` (each parameter's difference between the baseline and a twin of it, by
    :func:`gradient_differences` with ``norm="l2"``: a model whose backward is not deterministic,
    such as an embedding's that accumulates with atomics), each difference is the relative L2
    distance ``|a - b|_2 / |b|_2`` and may be up to :data:`NONDETERMINISM_MARGIN` times the twin's
    (an L2 distance over a whole tensor is steady from run to run; the largest element's is not).
    A parameter with no gradient in both is equal; with one in one of them only, it differs
    wholly (1.0), as does a non-finite difference."""
    values = gradient_differences(model, reference, norm="max" if noise is None else "l2")
    if values is None or (noise is not None and len(noise) != len(values)):
        return 1.0, False
    allowed = [t if noise is None else max(t, NONDETERMINISM_MARGIN * n)
               for (_, t), n in zip(values, noise if noise is not None else [0.0] * len(values))]
    ok = all(v <= a for (v, _), a in zip(values, allowed))
    return max([v for v, _ in values], default=0.0), ok


NONDETERMINISM_MARGIN = 4.0
"""How much further than a twin of the baseline (in relative L2 distance, per parameter) a plan
exact by construction may be from the baseline, on a model whose backward is not deterministic
(seen on an H200: the reference DLRM's gradients after eight steps differ by 1.5-5% at their
largest element between runs of one plan). A plan that really changes a gradient (a detached
branch, a misaligned dropout mask) moves it by its whole size."""


def gradient_differences(model: torch.nn.Module, reference: torch.nn.Module,
                         norm: str = "max") -> list[tuple[float, float]] | None:
    """Per parameter with a gradient in either model: ``(relative difference, dtype tolerance)``
    (see :func:`gradient_difference`; ``norm`` is ``max`` or ``l2``); None when the models'
    parameters do not match. One host sync for all parameters."""
    ours, theirs = list(model.named_parameters()), list(reference.named_parameters())
    if [n for n, _ in ours] != [n for n, _ in theirs]:
        return None
    rels: list[torch.Tensor] = []
    tols: list[float] = []
    missing: list[int] = []
    for (_, p), (_, q) in zip(ours, theirs):
        a, b = p.grad, q.grad
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            missing.append(len(rels))
            rels.append(torch.ones((), dtype=torch.float64, device=(a if a is not None else b).device))
            tols.append(0.0)
            continue
        a = a.to_dense() if a.is_sparse else a
        b = b.to_dense() if b.is_sparse else b
        if norm == "l2":
            diff = torch.linalg.vector_norm((a - b).double()) if a.numel() else a.new_zeros((), dtype=torch.float64)
            scale = torch.linalg.vector_norm(b.double()) if a.numel() else a.new_ones((), dtype=torch.float64)
        else:
            diff = (a - b).abs().max() if a.numel() else a.new_zeros(())
            scale = torch.maximum(a.abs().max(), b.abs().max()) if a.numel() else a.new_ones(())
        rels.append(torch.where(diff == 0, diff, diff / scale).to(torch.float64).reshape(()))
        tols.append(EXACT_RTOL.get(a.dtype, 0.0))
    if not rels:
        return []
    one_device = len({r.device for r in rels}) == 1
    values = (torch.stack(rels).cpu() if one_device else torch.stack([r.cpu() for r in rels])).tolist()
    values = [v if math.isfinite(v) else 1.0 for v in values]
    for i in missing:  # a gradient in one model only is no tolerance's to forgive
        values[i] = 1.0
    return list(zip(values, tols))


def _interval(e: GainEstimate) -> tuple[float, float, float]:
    return (e.gain, e.lo, e.hi)


def _agree_worst(diff: float, ok: bool, device: torch.device, process_group: Any) -> tuple[float, bool]:
    """The largest difference and the worst verdict over the ranks of ``process_group``."""
    import torch.distributed as dist

    flags = torch.tensor([diff, 0.0 if ok else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
    worst, failed = flags.tolist()
    return worst, failed == 0.0


def agree_with_rank0(device: torch.device, process_group: Any) -> Callable[[list[float]], Sequence[float]]:
    """``agree`` for :func:`~erase_tune.measure.measure_gains` across ``process_group``: every rank acts
    on rank 0's window gains, so every rank stops the same runners at the same round."""
    import torch.distributed as dist

    source = dist.get_global_rank(process_group, 0)

    def agree(gains: list[float]) -> Sequence[float]:
        values = torch.tensor(gains, dtype=torch.float64, device=device)
        dist.broadcast(values, src=source, group=process_group)
        return values.tolist()

    return agree


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
    Run it before anything else in the process; see :func:`capture_error`."""
    return capture_error(workload, ErasePlan(whole_step_graph=True), device, seed=seed)


def capture_error(workload: Workload, plan: ErasePlan, device: str | torch.device | None = None, *, seed: int = 0,
                  init: torch.nn.Module | None = None, data: WorkloadData | None = None) -> str | None:
    """Try ``plan``'s CUDA graphs once: None when they capture and replay, else why not (the
    :class:`~erase_tune.errors.CaptureError`'s line). None on the CPU (no graph there).

    A copy of the workload's model (``init``, else one built after ``torch.manual_seed(seed)``)
    is trained under ``plan`` for the engine's warm-up, the capture and one replay, on the
    workload's own batches (``data``, else made here). A failed capture can leave the process's
    CUDA RNG in capture state (see :class:`~erase_tune.errors.CaptureError`), so it is repaired
    here and checked with one draw; if it cannot be, :class:`TrialFailed` says so (run again in a
    fresh process with the graph off). Other errors (the workload's own) propagate.
    """
    device = resolve_device(device)
    if device.type != "cuda":
        return None
    if init is None or data is None:
        torch.manual_seed(seed)
        data = workload.make_data(device)
        init = workload.build_model()
    engine: EraseEngine | None = None
    error: str | None = None
    try:
        engine = build_engine(workload, plan, init, data, device)
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
