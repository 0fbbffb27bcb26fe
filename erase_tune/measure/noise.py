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

Quality confirmation (:func:`confirm_quality`) trains finalists longer, over several seeds,
against the baseline trained the same way (same batches, same dropout masks), and reports each
NE gap with a 95% interval.
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
from erase_tune.workloads import Workload, WorkloadData

__all__ = ["NoiseFloor", "QualityConfirmation", "QualityResult", "QualitySettings", "TrainStart",
           "measure_noise_floor", "confirm_quality", "exact_by_construction", "feasible", "train_ne", "MAX_REPEATS"]


def feasible(ne_gap: float, max_ne_gap: float, band: float = 0.0, *, exact: bool = False) -> bool:
    """The NE budget with the noise floor: infeasible only when the gap is above the budget
    beyond the noise (``ne_gap > max_ne_gap + band``); a plan exact by construction always is."""
    return exact or ne_gap <= max_ne_gap + band


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """How much the NE gap moves between equivalent trainings, with provenance."""

    band: float
    """Largest |gap| of any perturbation: gaps within ±band are indistinguishable from noise."""
    gaps: tuple[float, ...]
    """Each perturbation's NE gap against the reference."""
    kinds: tuple[str, ...]
    """What each perturbation was: ``order`` (another data order) or ``graph`` (whole-step graph)."""
    ne_reference: float
    training_steps: int
    repeats: int
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.gaps) != len(self.kinds):
            raise ValueError("NoiseFloor: one kind per gap")
        if not (math.isfinite(self.band) and self.band >= 0):
            raise ValueError(f"NoiseFloor: band {self.band} must be finite and >= 0")

    def describe(self) -> str:
        """One line: the band and what it came from."""
        kinds = ", ".join(f"{k} {g:+.3%}" for k, g in zip(self.kinds, self.gaps))
        return f"±{self.band:.3%} (NE gap of the baseline against itself, {self.training_steps} steps: {kinds})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (a study attribute, a table row, a JSON file)."""
        out = dataclasses.asdict(self)
        out["gaps"], out["kinds"], out["provenance"] = list(self.gaps), list(self.kinds), dict(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NoiseFloor:
        return cls(band=float(data["band"]), gaps=tuple(float(g) for g in data["gaps"]),
                   kinds=tuple(str(k) for k in data["kinds"]), ne_reference=float(data["ne_reference"]),
                   training_steps=int(data["training_steps"]), repeats=int(data["repeats"]),
                   provenance=dict(data.get("provenance") or {}))


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
    data, init = prepare(workload, device, budget.seed)
    steps = budget.training_steps
    base = ErasePlan()
    start = TrainStart(workload=workload, init=init, data=data, device=device, process_group=process_group)
    try:
        reference = train_ne(start, base, steps, random_seed=budget.seed, check=True)
        gaps, kinds = [], []
        for r in range(repeats):  # another order of the batches, and other dropout masks
            seed = budget.seed * 1000 + r + 1
            ne = train_ne(start, base, steps, order_seed=seed, random_seed=seed)
            gaps.append((ne - reference) / reference)
            kinds.append("order")
        if graph:
            ne = train_ne(start, ErasePlan(whole_step_graph=True), steps, random_seed=budget.seed)
            gaps.append((ne - reference) / reference)
            kinds.append("graph")
    finally:
        release((), device)
    _, world = ranks_of(process_group)
    return NoiseFloor(
        band=max(abs(g) for g in gaps), gaps=tuple(gaps), kinds=tuple(kinds), ne_reference=reference,
        training_steps=steps, repeats=repeats,
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), training_steps=steps, repeats=repeats, ranks=world,
                              graph_left_out=graph_error, duration_s=round(time.perf_counter() - started, 3)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityConfirmation:
    """One plan's NE gap after the longer training, over seeds."""

    ne_gap: float
    """Mean over seeds of the per-seed NE gap against the baseline trained the same way."""
    lo: float
    hi: float
    """95% Student-t interval of that mean."""
    per_seed: tuple[float, ...]
    exact: bool = False
    """Exact by construction (no cuts): not trained; its gap is 0 and its interval the noise band."""

    def above_budget(self, max_ne_gap: float, band: float = 0.0) -> bool:
        """The confirmed gap is above the budget beyond the noise (the export refuses the plan)."""
        return not feasible(self.ne_gap, max_ne_gap, band, exact=self.exact)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityResult:
    """Quality confirmations by plan name, with provenance."""

    steps: int
    seeds: tuple[int, ...]
    plans: Mapping[str, QualityConfirmation]
    ne_baseline: tuple[float, ...]
    """The baseline's NE for each seed."""
    provenance: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualitySettings:
    """How long and how often :func:`confirm_quality` trains, and the band an exact plan's gap gets."""

    scale: int = 4
    """Each training is this many times the trial's training steps."""
    seeds: int = 3
    """Data orders (seeds) trained; the NE gap's interval is over these."""
    band: float = 0.0
    """The noise floor: an exact plan's gap is 0 ± this."""


def confirm_quality(workload: Workload, plans: Mapping[str, ErasePlan], *, budget: Budget,
                    settings: QualitySettings = QualitySettings(), device: str | torch.device | None = None,
                    process_group: Any = None, progress: Callable[[str], None] = lambda s: None,
                    exact: Collection[str] | None = None) -> QualityResult:
    """Train each plan in ``plans`` and the baseline for ``settings.scale`` × the trial's training
    steps, from the same init, once per seed (seed ``k`` of ``settings.seeds`` trains the batches
    in the order permuted by ``k``; the first seed is the trial's own order), and report each
    plan's NE gap with a 95% interval over seeds. Exact plans are not trained: gap 0, interval
    ±``settings.band``; ``exact`` names them (the plans a trial's gradient check verified), else
    every plan exact by construction is."""
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
    orders = [None, *(budget.seed * 1000 + 500 + k for k in range(1, seeds))]
    base_ne: list[float] = []
    per: dict[str, list[float]] = {name: [] for name in trained}
    start = TrainStart(workload=workload, init=init, data=data, device=device, process_group=process_group)
    try:
        for order in orders:
            if not trained:
                break
            masks = budget.seed if order is None else order  # a plan draws its baseline's masks
            ref = train_ne(start, ErasePlan(), steps, order_seed=order, random_seed=masks, check=not base_ne)
            base_ne.append(ref)
            for name, p in trained.items():
                progress(f"quality: plan {name}, order {order}")
                ne = train_ne(start, p, steps, order_seed=order, random_seed=masks)
                per[name].append((ne - ref) / ref)
    finally:
        release((), device)
    out: dict[str, QualityConfirmation] = {}
    for name in plans:
        if name not in trained:
            out[name] = QualityConfirmation(ne_gap=0.0, lo=-band, hi=band, per_seed=(), exact=True)
            continue
        mean, lo, hi = t_interval(per[name])
        out[name] = QualityConfirmation(ne_gap=mean, lo=lo, hi=hi, per_seed=tuple(per[name]))
    _, world = ranks_of(process_group)
    return QualityResult(
        steps=steps, seeds=tuple(-1 if o is None else o for o in orders), plans=out, ne_baseline=tuple(base_ne),
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), training_steps=steps, scale=scale, seeds=seeds,
                              ranks=world, duration_s=round(time.perf_counter() - started, 3)),
    )
