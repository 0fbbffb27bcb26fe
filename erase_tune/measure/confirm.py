"""A second look before a plan leaves the study: re-time front plans against their baseline.

A study measures each plan once, in its own trial, and a single measurement can be lucky
(the CPU-launch-bound eager baseline drifts from window to window and trial to trial). So
before a plan is exported, the plans on the front are timed again, all in ONE process,
interleaved with the baseline in alternating windows, by the same sequential protocol as a
trial (:func:`erase_tune.measure.measure_gains`, every plan against the one baseline): at least
``windows`` windows, then on for each plan until its gain's 95% interval is at most
``±halfwidth`` (±2% by default: tighter than a search's ±3%) or ``max_windows``. A plan whose
interval is narrow leaves the rotation; the baseline runs while any plan does.

A plan's gain in one window is the ratio of the window medians of per-step QPS, plan over
baseline, minus 1 (the median of a window: one slow step does not move it; this was the p90 of
the window before the sequential protocol). The reported gain is the mean of those per-window
gains with a 95% Student-t interval over windows.

A plan whose interval includes 0 has not shown a gain, and the export refuses to call it
one. A plan that *is* the baseline (no cuts, no placements, the baseline's own execution)
is not timed at all: its gain is 0 by definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from erase_tune.errors import EraseTuneError
from erase_tune.measure import GainEstimate, ProtocolHooks, ProtocolResult, StopRule, measure_gains, provenance
from erase_tune.runtime import ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.measure.trial import (
    GAIN_OVER,
    Budget,
    Variant,
    agree_with_rank0,
    build_engine,
    jsonable_args,
    prepare,
    ranks_of,
    release,
)
from erase_tune.workloads import Workload, WorkloadData

__all__ = ["GAIN_OVER", "ConfirmWindows", "PlanConfirmation", "ConfirmResult", "baseline_plan", "confirm_plans"]


@dataclasses.dataclass(frozen=True)
class PlanConfirmation:
    """One plan's confirmed gain over the baseline: the protocol's estimate of it, or none for a
    plan that is the baseline itself (not timed: its gain is 0, over no windows)."""

    estimate: GainEstimate | None
    """The plan's gain over the baseline as the protocol measured it (its mean over windows of the
    per-window gain, window-median QPS ratio over the baseline minus 1, with the 95% interval of
    that mean); None for the baseline itself."""

    @property
    def is_baseline(self) -> bool:
        """The plan is the baseline itself: nothing to time, the gain is 0."""
        return self.estimate is None

    @property
    def gain(self) -> float:
        """Mean over windows of the per-window gain (0 for the baseline itself)."""
        return 0.0 if self.estimate is None else self.estimate.gain

    @property
    def lo(self) -> float:
        """Lower end of the 95% interval of that mean (0 for the baseline itself)."""
        return 0.0 if self.estimate is None else self.estimate.lo

    @property
    def hi(self) -> float:
        """Upper end of that interval (0 for the baseline itself)."""
        return 0.0 if self.estimate is None else self.estimate.hi

    @property
    def per_window(self) -> tuple[float, ...]:
        """The per-window gains, in window order (empty for the baseline itself)."""
        return () if self.estimate is None else self.estimate.per_window

    @property
    def windows(self) -> int:
        """Windows the plan was timed over (0: the baseline itself, not timed)."""
        return 0 if self.estimate is None else self.estimate.windows

    @property
    def stopped(self) -> str:
        """Why its timing stopped: ``narrow`` (interval within ±halfwidth) or ``cap``; ``""`` for the baseline itself."""
        return "" if self.estimate is None else self.estimate.stopped


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmResult:
    """Confirmations by plan name, with the raw samples and provenance."""

    gain_over: str
    windows: int
    """The most windows any plan was timed over; when none was (every plan is the baseline itself,
    whose gain is 0 without timing), the minimum asked for, so that the confirmation counts as
    one of at least that many windows."""
    plans: Mapping[str, PlanConfirmation]
    samples: Mapping[str, Mapping[str, list]]
    """Per variant (``baseline`` and each plan): ``{"steps_s": [...], "window": [...]}``."""
    provenance: Mapping[str, Any]


def baseline_plan(gain_over: str) -> ErasePlan:
    """The plan a gain is measured against."""
    if gain_over not in GAIN_OVER:
        raise EraseTuneError(f"gain_over: {gain_over!r} is not one of {', '.join(GAIN_OVER)}")
    return ErasePlan(whole_step_graph=gain_over == "graph")




@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmWindows:
    """How long a confirmation times (checked by :func:`confirm_plans`): at least ``windows``
    windows (``--repeats``), then each plan until its gain's 95% interval is at most
    ``±halfwidth``, at most ``max_windows``."""

    windows: int
    max_windows: int = 40
    halfwidth: float = 0.02


def confirm_plans(
    workload: Workload,
    plans: Mapping[str, ErasePlan],
    *,
    budget: Budget,
    timing: ConfirmWindows,
    gain_over: str = "eager",
    device: str | torch.device | None = None,
    process_group: Any = None,
) -> ConfirmResult:
    """Time every plan in ``plans`` against the ``gain_over`` baseline in one process,
    interleaved, in windows of ``budget.window_steps`` steps after ``budget.warmup_steps``
    warm-up steps each: at least ``timing.windows`` windows, then each plan until its gain's 95%
    interval is at most ``±timing.halfwidth``, at most ``timing.max_windows``. ``process_group``:
    as one rank of a data-parallel trial (see :func:`erase_tune.measure.trial.run_trial`; every
    rank acts on rank 0's window gains)."""
    windows, max_windows, halfwidth = timing.windows, timing.max_windows, timing.halfwidth
    rule = _confirm_rule(windows, max_windows, halfwidth)
    device = resolve_device(device)
    base = baseline_plan(gain_over)
    if base.whole_step_graph and device.type != "cuda":
        raise EraseTuneError("gain_over: graph needs CUDA (the whole-step-graph baseline does not exist on the CPU)")
    data, init = prepare(workload, device, budget.seed)
    same = {name for name, p in plans.items() if p.canonical().to_dict() == base.canonical().to_dict()}
    timed = {"baseline": base, **{name: p for name, p in plans.items() if name not in same}}
    for name, p in timed.items():
        p.check_model(init)
    world = ranks_of(process_group)[1]
    measured = None
    if len(timed) > 1:  # something to compare with the baseline
        measured = _time_plans(workload, timed, init, data, device, budget, rule, process_group)
    out = _confirmations(plans, same, measured)
    return ConfirmResult(
        gain_over=gain_over, windows=measured.rounds if measured is not None else windows, plans=out,
        samples={k: v.to_dict() for k, v in measured.timings.variants.items()} if measured is not None else {},
        provenance=provenance(device, workload=workload.name, workload_args=jsonable_args(workload.args),
                              budget=dataclasses.asdict(budget), windows=windows, max_windows=max_windows,
                              halfwidth=halfwidth, gain_over=gain_over, ranks=world),
    )


def _confirm_rule(windows: int, max_windows: int, halfwidth: float) -> StopRule:
    """The confirmation's stop rule, its settings checked (``windows`` is ``--repeats``)."""
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 2:
        raise EraseTuneError(f"--repeats: {windows!r} must be an integer >= 2 (an interval needs two windows)")
    if isinstance(max_windows, bool) or not isinstance(max_windows, int) or max_windows < windows:
        raise EraseTuneError(f"max_windows: {max_windows!r} must be an integer >= the minimum windows ({windows})")
    if isinstance(halfwidth, bool) or not isinstance(halfwidth, (int, float)) or not (
            math.isfinite(halfwidth) and 0 < halfwidth < 1):
        raise EraseTuneError(f"halfwidth: {halfwidth!r} must be a number in (0, 1), e.g. 0.02 for ±2%")
    return StopRule(min_windows=windows, max_windows=max_windows, halfwidth=halfwidth)


def _time_plans(workload: Workload, timed: Mapping[str, ErasePlan], init: torch.nn.Module, data: WorkloadData,
                device: torch.device, budget: Budget, rule: StopRule, process_group: Any) -> ProtocolResult:
    """``timed`` (the baseline among them) timed by the one protocol, each plan against the baseline."""
    rank, world = ranks_of(process_group)
    variants: dict[str, Variant] = {}
    try:
        for name, p in timed.items():
            variants[name] = Variant(plan=p, engine=build_engine(workload, p, init, data, device, process_group),
                                     data=data, rank=rank, world=world)
        return measure_gains(
            variants, device=device, steps=budget.steps(), rule=rule,
            pairs={name: "baseline" for name in timed if name != "baseline"},
            hooks=ProtocolHooks(agree=agree_with_rank0(device, process_group) if process_group is not None else None),
        )
    finally:
        release(variants.values(), device)
        variants.clear()


def _confirmations(plans: Mapping[str, ErasePlan], same: Collection[str],
                   measured: ProtocolResult | None) -> dict[str, PlanConfirmation]:
    """Each plan's confirmation: its measured gain, or none for a plan that is the baseline (``same``)."""
    out: dict[str, PlanConfirmation] = {}
    for name in plans:
        if name in same:
            out[name] = PlanConfirmation(None)
            continue
        assert measured is not None  # a plan that is not the baseline was timed
        out[name] = PlanConfirmation(measured.gains[name])
    return out
