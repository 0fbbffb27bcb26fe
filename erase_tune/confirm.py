"""A second look before a plan leaves the study: re-time front plans against their baseline.

A study measures each plan once, in its own trial, and a single measurement can be lucky
(the CPU-launch-bound eager baseline drifts from window to window and trial to trial). So
before a plan is exported, the plans on the front are timed again, all in ONE process,
interleaved with the baseline in alternating windows (the same protocol as a trial), for
``windows`` more windows. Each plan's gain is then known per window; the reported gain is
the mean of the per-window gains of p90 QPS with a 95% Student-t interval over windows.

A plan whose interval includes 0 has not shown a gain, and the export refuses to call it
one. A plan that *is* the baseline (no cuts, no placements, the baseline's own execution)
is not timed at all: its gain is 0 by definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from erase_tune.errors import EraseTuneError
from erase_tune.measure import provenance, ratio_spread, time_interleaved
from erase_tune.runtime import ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.trial import Budget, Variant, build_engine, jsonable_args, ranks_of, release
from erase_tune.workloads import Workload

__all__ = ["GAIN_OVER", "PlanConfirmation", "ConfirmResult", "baseline_plan", "confirm_plans", "t_interval"]

GAIN_OVER = ("eager", "graph")
"""``eager``: over the plain engine with no cuts. ``graph``: over the whole step captured as
one CUDA graph with no cuts (CUDA only)."""

# Two-sided 97.5% quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfirmation:
    """One plan's confirmed gain over the baseline."""

    gain: float
    """Mean over windows of the per-window p90-QPS gain."""
    lo: float
    hi: float
    """95% interval of that mean."""
    per_window: tuple[float, ...]
    is_baseline: bool = False
    """The plan is the baseline itself: nothing to time, the gain is 0."""

    @property
    def shows_gain(self) -> bool:
        """The whole interval lies above 0."""
        return not self.is_baseline and self.lo > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmResult:
    """Confirmations by plan name, with the raw samples and provenance."""

    gain_over: str
    windows: int
    plans: Mapping[str, PlanConfirmation]
    samples: Mapping[str, Mapping[str, list]]
    """Per variant (``baseline`` and each plan): ``{"steps_s": [...], "window": [...]}``."""
    provenance: Mapping[str, Any]


def baseline_plan(gain_over: str) -> ErasePlan:
    """The plan a gain is measured against."""
    if gain_over not in GAIN_OVER:
        raise EraseTuneError(f"gain_over: {gain_over!r} is not one of {', '.join(GAIN_OVER)}")
    return ErasePlan(whole_step_graph=gain_over == "graph")


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95% Student-t interval; one value gives a zero-width interval."""
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return mean, mean, mean
    df = x.size - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    half = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


def confirm_plans(
    workload: Workload,
    plans: Mapping[str, ErasePlan],
    *,
    budget: Budget,
    windows: int,
    gain_over: str = "eager",
    device: str | torch.device | None = None,
    process_group: Any = None,
) -> ConfirmResult:
    """Time every plan in ``plans`` against the ``gain_over`` baseline in one process,
    interleaved, for ``windows`` windows of ``budget.window_steps`` steps after
    ``budget.warmup_steps`` warm-up steps each. ``process_group``: as one rank of a
    data-parallel trial (see :func:`erase_tune.trial.run_trial`)."""
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 2:
        raise EraseTuneError(f"--repeats: {windows!r} must be an integer >= 2 (an interval needs two windows)")
    device = resolve_device(device)
    base = baseline_plan(gain_over)
    if base.whole_step_graph and device.type != "cuda":
        raise EraseTuneError("gain_over: graph needs CUDA (the whole-step-graph baseline does not exist on the CPU)")
    torch.manual_seed(budget.seed)
    data = workload.make_data(device)
    init = workload.build_model()
    same = {name for name, p in plans.items() if p.canonical().to_dict() == base.canonical().to_dict()}
    timed = {"baseline": base, **{name: p for name, p in plans.items() if name not in same}}
    for name, p in timed.items():
        p.check_model(init)
    rank, world = ranks_of(process_group)
    variants: dict[str, Variant] = {}
    try:
        for name, p in timed.items():
            variants[name] = Variant(plan=p, engine=build_engine(workload, p, init, data, device, process_group),
                                     data=data, rank=rank, world=world)
        timings = time_interleaved(variants, device=device, warmup_steps=budget.warmup_steps, windows=windows,
                                   window_steps=budget.window_steps)
    finally:
        release(variants.values(), device)
        variants.clear()
    batch = workload.batch_size * world
    out: dict[str, PlanConfirmation] = {}
    for name in plans:
        if name in same:
            out[name] = PlanConfirmation(gain=0.0, lo=0.0, hi=0.0, per_window=(), is_baseline=True)
            continue
        spread = ratio_spread(timings.variants[name], timings.variants["baseline"], batch, statistic="p90")
        gains = [r - 1.0 for r in spread.per_window]
        mean, lo, hi = t_interval(gains)
        out[name] = PlanConfirmation(gain=mean, lo=lo, hi=hi, per_window=tuple(gains))
    return ConfirmResult(
        gain_over=gain_over, windows=windows, plans=out,
        samples={k: v.to_dict() for k, v in timings.variants.items()},
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), windows=windows, gain_over=gain_over,
                              ranks=world),
    )
