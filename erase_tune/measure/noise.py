"""The noise floor of the NE gap: how far it moves between trainings that are the same mathematics.

A trial's NE gap compares two short trainings. Two trainings that compute the same thing up
to floating-point rounding do not end at the same NE: in bf16 one ulp of difference after the
first step is amplified by a short training into a gap of percents (issue 17: the no-cuts
whole-step-graph plan of a bf16 GPT measured +2% against its eager twin). A budget below that
floor judges noise. So before a study's trials the noise floor is measured:

- the **reference**: the baseline (no cuts) trained exactly as a trial's baseline is (same
  seed, same init, batches in order), for the trial's training steps;
- **perturbations that cannot matter**, each the baseline again from the same init:
  ``order`` (the same batches in another order, one permutation per repeat, with other
  dropout masks: the model's own randomness is noise a plan's gap may show) and, on CUDA,
  ``graph`` (the whole step captured as one CUDA graph with a capturable optimizer: the same
  mathematics, numerically different);
- each perturbation's NE gap against the reference, and the **band**: the largest |gap|.

A plan is then judged infeasible only when its gap exceeds ``max_ne_gap + band``, and a plan
that is exact by construction (no cuts: placements and graphed pieces only, with or without
the whole-step graph) is never judged on its gap at all (:func:`exact_by_construction`, defined
with the trial, which checks it: :func:`erase_tune.measure.trial.run_trial` compares such a plan's
gradients with the baseline's and, when they agree, does not train it for NE at all).

Quality confirmation (:func:`confirm_quality`) trains finalists over other data orders (seeds),
``budget.quality_scale`` times a trial's steps, against the baseline trained the same way (same
batches, same dropout masks), and reports each NE gap with a 95% interval. Its orders are the
noise floor's (:func:`data_order`) and never the trial's own (the plan was chosen on that one:
reusing it would confirm the luck that chose it). At the trial's length (scale 1, the default)
the baseline's trainings on those orders are the noise floor's, so they are not trained again
(:attr:`NoiseFloor.baseline_ne`): the confirmation costs one training per plan and seed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from erase_tune.errors import EraseTuneError
from erase_tune.measure import provenance, t_interval
from erase_tune.measure.rng import SeededRandom
from erase_tune.runtime import ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.measure.trial import (
    MAX_REPEATS,
    Budget,
    TrialFailed,
    build_engine,
    check_workload_loss,
    exact_by_construction,
    jsonable_args,
    prepare,
    reference_capture_error,
    ranks_of,
    release,
)
from erase_tune.measure.quality import (
    NoiseFloor,
    QualityConfirmation,
    QualityResult,
    QualitySettings,
    data_order,
    feasible,
    quality_trainings,
)
from erase_tune.workloads import Workload, WorkloadData

__all__ = ["NoiseFloor", "QualityConfirmation", "QualityResult", "QualitySettings", "TrainStart", "data_order",
           "measure_noise_floor", "confirm_quality", "quality_trainings", "exact_by_construction", "feasible",
           "train_ne", "MAX_REPEATS"]


def _order(steps: int, pool: int, seed: int | None) -> list[int]:
    """Batch index of each step: in order (``seed`` None), or the same batches permuted."""
    order = [s % pool for s in range(steps)]
    if seed is None:
        return order
    g = torch.Generator().manual_seed(seed)
    return [order[i] for i in torch.randperm(steps, generator=g).tolist()]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStart:
    """What every NE training of one measurement starts from: the workload, its initial model
    and data on ``device``, and the data-parallel group (None: this process alone)."""

    workload: Workload
    init: torch.nn.Module
    data: WorkloadData
    device: torch.device
    process_group: Any = None


def train_ne(start: TrainStart, plan: ErasePlan, steps: int, *, random_seed: int, order_seed: int | None = None,
             check: bool = False) -> float:
    """Train a copy of ``start.init`` under ``plan`` for ``steps`` steps and return its held-out NE.
    ``order_seed`` None trains on the batches in a trial's order; otherwise the same batches
    in an order permuted by that seed. The steps draw their random numbers (dropout masks) from
    ``random_seed``'s own sequence (:class:`~erase_tune.measure.rng.SeededRandom`): a trial's
    variants draw from ``budget.seed``'s. ``check``: check the workload's loss first
    (:func:`erase_tune.measure.trial.check_workload_loss`). Data parallel: rank r trains batch ``s·k + r`` of the
    (permuted) order, as a trial does."""
    workload, data, device, process_group = start.workload, start.data, start.device, start.process_group
    rank, world = ranks_of(process_group)
    init = start.init
    engine = build_engine(workload, plan, init, data, device, process_group)
    if check:
        try:
            check_workload_loss(workload, engine.model, data)
        except BaseException:
            engine.close()
            raise
    order = _order(steps * world, len(data.train), order_seed)
    random = SeededRandom(device, random_seed)
    try:
        loss = None
        for s in range(steps):
            inputs, target = data.train[order[s * world + rank]]
            with random.drawing():
                loss = engine.step(inputs, target)
        if loss is not None and not bool(torch.isfinite(loss)):
            raise TrialFailed(f"training loss became {float(loss)} ({plan.describe()})")
        ne = workload.normalized_entropy(engine.model, data)
    finally:
        engine.close()
    if not math.isfinite(ne):
        raise TrialFailed(f"held-out NE is {ne} ({plan.describe()})")
    return ne


def measure_noise_floor(workload: Workload, budget: Budget = Budget(), *, repeats: int = 3,
                        device: str | torch.device | None = None, graph: bool | None = None,
                        process_group: Any = None) -> NoiseFloor:
    """Measure the noise floor of ``workload`` at ``budget``'s training length; see the module
    docstring. ``repeats`` data orders; ``graph`` adds the whole-step-graph perturbation (default:
    on CUDA, where the model's step can be captured whole: one that cannot, such as the reference
    DLRM's, is measured on data orders alone and its provenance says why)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise EraseTuneError(f"noise repeats: {repeats!r} must be an integer in 1..{MAX_REPEATS}")
    started = time.perf_counter()
    device = resolve_device(device)
    graph_error = None
    if graph is None and device.type == "cuda":  # tried first in the process (see reference_capture_error)
        graph_error = reference_capture_error(workload, device, seed=budget.seed)
    graph = device.type == "cuda" and graph_error is None if graph is None else graph
    if graph and device.type != "cuda":
        raise EraseTuneError("noise floor: the whole-step-graph perturbation needs CUDA")
    base = ErasePlan()
    # (kind, plan, order seed, random seed): the reference on the trial's order, then each
    # perturbation that cannot matter: another order of the batches with other dropout masks,
    # and (CUDA) the same step replayed from one whole-step graph.
    runs = [("reference", base, None, budget.seed)] + [("order", base, s, s) for s in
                                                       (data_order(budget, r + 1) for r in range(repeats))]
    if graph:
        runs.append(("graph", ErasePlan(whole_step_graph=True), None, budget.seed))
    data, init = prepare(workload, device, budget.seed)
    steps = budget.training_steps
    start = TrainStart(workload=workload, init=init, data=data, device=device, process_group=process_group)
    try:
        nes = [train_ne(start, plan, steps, order_seed=order, random_seed=seed, check=kind == "reference")
               for kind, plan, order, seed in runs]
    finally:
        release((), device)
    reference = nes[0]
    gaps = [(ne - reference) / reference for ne in nes[1:]]
    kinds = [kind for kind, *_ in runs[1:]]
    baseline_ne = {order: ne for (kind, _, order, _), ne in zip(runs, nes) if kind == "order"}
    _, world = ranks_of(process_group)
    return NoiseFloor(
        band=max(abs(g) for g in gaps), gaps=tuple(gaps), kinds=tuple(kinds), ne_reference=reference,
        training_steps=steps, repeats=repeats, baseline_ne=baseline_ne,
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), training_steps=steps, repeats=repeats, ranks=world,
                              graph_left_out=graph_error, duration_s=round(time.perf_counter() - started, 3)),
    )


_SAME_MACHINE = ("device_name", "torch", "cuda", "ranks")
"""What a reused baseline training must share with the plan's: a paired NE gap compares two
trainings that differ only by the plan, not by the card, the library or the world size."""


def _reused(floor: NoiseFloor | None, steps: int, here: Mapping[str, Any] | None) -> Mapping[int, float]:
    """The baseline's NE by data order that ``floor`` trained for exactly ``steps`` steps on a
    machine like ``here`` (a provenance; None: assumed alike, for estimates). None when it trained
    another length (a longer confirmation trains its own baseline) or elsewhere."""
    if floor is None or floor.training_steps != steps:
        return {}
    if here is not None and any(floor.provenance.get(k) != here.get(k) for k in _SAME_MACHINE):
        return {}
    return floor.baseline_ne


def confirm_quality(workload: Workload, plans: Mapping[str, ErasePlan], *, budget: Budget,
                    settings: QualitySettings = QualitySettings(), device: str | torch.device | None = None,
                    process_group: Any = None, progress: Callable[[str], None] = lambda s: None,
                    exact: Collection[str] | None = None) -> QualityResult:
    """Train each plan in ``plans`` and the baseline for ``settings.scale`` × the trial's training
    steps, from the same init, once per seed: seed ``k`` of ``settings.seeds`` trains the batches
    in :func:`data_order` ``k`` (never the trial's own order) with that order's dropout masks, and
    report each plan's NE gap with a 95% interval over seeds. Exact plans are not trained: gap 0,
    interval ±``settings.band``; ``exact`` names them (the plans a trial's gradient check
    verified), else every plan exact by construction is. ``settings.floor``: the baseline
    trainings the job's noise floor already did, reused."""
    scale, seeds, band = settings.scale, settings.seeds, settings.band
    for name, value, low in (("quality scale", scale, 1), ("quality seeds", seeds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_REPEATS:
            raise EraseTuneError(f"{name}: {value!r} must be an integer in {low}..{MAX_REPEATS}")
    started = time.perf_counter()
    device = resolve_device(device)
    data, init = prepare(workload, device, budget.seed)
    steps = scale * budget.training_steps
    trained = {name: p for name, p in plans.items()
               if not (exact_by_construction(p) if exact is None else name in exact)}
    for p in trained.values():
        p.check_model(init)
    orders = [data_order(budget, k) for k in range(1, seeds + 1)]
    known = _reused(settings.floor, steps, provenance(device, ranks=ranks_of(process_group)[1]))
    start = TrainStart(workload=workload, init=init, data=data, device=device, process_group=process_group)
    try:
        base_ne, per = _train_orders(start, trained, orders, steps, known, progress) if trained else ([], {})
    finally:
        release((), device)
    out: dict[str, QualityConfirmation] = {}
    for name in plans:
        if name not in trained:
            out[name] = QualityConfirmation.of_exact(band)
            continue
        mean, lo, hi = t_interval(per[name])
        out[name] = QualityConfirmation(ne_gap=mean, lo=lo, hi=hi, per_seed=tuple(per[name]))
    _, world = ranks_of(process_group)
    return QualityResult(
        steps=steps, seeds=tuple(orders), plans=out, ne_baseline=tuple(base_ne),
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), training_steps=steps, scale=scale, seeds=seeds,
                              ranks=world, baseline_from_noise_floor=sorted(o for o in orders if o in known),
                              duration_s=round(time.perf_counter() - started, 3)),
    )


def _train_orders(start: TrainStart, trained: Mapping[str, ErasePlan], orders: list[int], steps: int,
                  known: Mapping[int, float],
                  progress: Callable[[str], None]) -> tuple[list[float], dict[str, list[float]]]:
    """The baseline's NE on each order (``known``'s where it has it, else trained) and each
    plan's NE gap against it; the workload's loss is checked on the first training run here."""
    base_ne: list[float] = []
    per: dict[str, list[float]] = {name: [] for name in trained}
    checked = False
    for order in orders:
        if order in known:
            ref = known[order]
        else:
            ref = train_ne(start, ErasePlan(), steps, order_seed=order, random_seed=order, check=not checked)
            checked = True
        base_ne.append(ref)
        for name, p in trained.items():
            progress(f"quality: plan {name}, order {order}")
            ne = train_ne(start, p, steps, order_seed=order, random_seed=order, check=not checked)
            checked = True
            per[name].append((ne - ref) / ref)
    return base_ne, per
