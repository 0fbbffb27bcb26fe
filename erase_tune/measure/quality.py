"""The records of the NE side of a measurement, and the arithmetic on them, without torch: the
noise floor of the NE gap, the quality confirmation's result and settings, what is feasible,
and how many trainings a confirmation runs. The readers of a study (``status``, ``report``,
``export`` of a confirmed front) import these and never the trainings
(:mod:`erase_tune.measure.noise`, which re-exports them)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from erase_tune.measure.records import Budget

__all__ = ["NoiseFloor", "QualityConfirmation", "QualityResult", "QualitySettings", "data_order", "feasible",
           "quality_trainings"]


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
    baseline_ne: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """The baseline's held-out NE after ``training_steps`` on each ``order`` perturbation's data
    order (:func:`data_order`; its dropout masks drawn from the same seed): what a quality
    confirmation of the same length reuses. Empty for a floor stored before it was kept."""

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
        out["baseline_ne"] = {str(k): v for k, v in self.baseline_ne.items()}  # JSON keys are strings
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NoiseFloor:
        return cls(band=float(data["band"]), gaps=tuple(float(g) for g in data["gaps"]),
                   kinds=tuple(str(k) for k in data["kinds"]), ne_reference=float(data["ne_reference"]),
                   training_steps=int(data["training_steps"]), repeats=int(data["repeats"]),
                   provenance=dict(data.get("provenance") or {}),
                   baseline_ne={int(k): float(v) for k, v in (data.get("baseline_ne") or {}).items()})


def data_order(budget: Budget, k: int) -> int:
    """The seed of the ``k``-th other data order (``k`` >= 1) of ``budget``: its batches' permutation
    and its dropout masks. The noise floor's ``order`` perturbations and the quality
    confirmation's seeds are the same orders, so the baseline trained on one serves both."""
    return budget.seed * 1000 + k


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

    @classmethod
    def of_exact(cls, band: float) -> QualityConfirmation:
        """An exact plan's: not trained, gap 0, interval ±``band`` (the noise floor)."""
        return cls(ne_gap=0.0, lo=-band, hi=band, per_seed=(), exact=True)

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

    scale: int = 1
    """Each training is this many times the trial's training steps."""
    seeds: int = 3
    """Data orders (seeds) trained; the NE gap's interval is over these."""
    band: float = 0.0
    """The noise floor: an exact plan's gap is 0 ± this."""
    floor: NoiseFloor | None = None
    """The job's noise floor, measured for this budget on this workload: where it trained the
    baseline on an order for the same steps on a machine like this one, that NE is used and the
    baseline is not trained again."""


def quality_trainings(plans: int, budget: Budget, *, floor: bool) -> int:
    """How many trainings (each ``budget.quality_scale`` × a trial's steps) :func:`confirm_quality`
    runs for ``plans`` plans that are trained: each plan once per seed, and the baseline once per
    seed that the noise floor (``floor``: measured for this budget on this machine) did not train:
    at scale 1 its ``noise_repeats`` orders are the confirmation's first ones (:func:`data_order`)."""
    if not plans or not budget.quality_scale:
        return 0
    known = min(budget.noise_repeats, budget.quality_seeds) if floor and budget.quality_scale == 1 else 0
    return (plans + 1) * budget.quality_seeds - known
