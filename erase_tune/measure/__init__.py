"""Measurement: interleaved device-side step timing, QPS statistics, stream overlap, provenance.

These numbers are the product (docs/design.md, "Measurement rules"): baseline and candidate are
timed in the same process, alternating in windows; throughput is reported as p90 and median
per-step QPS with its spread over windows; every figure carries its provenance. Every gain
comes from one sequential protocol (:func:`measure_gains`): windows until the gain's 95%
interval is narrow enough, the plan is behind the bound it races against, or a cap.

What uses the protocol lives here too, imported by module name (they load the runtime and workloads):
:mod:`~erase_tune.measure.trial` (one trial: baseline vs candidate in one process),
:mod:`~erase_tune.measure.confirm` (the second look at a front's speed),
:mod:`~erase_tune.measure.noise` (the NE gap's noise floor, quality over seeds),
:mod:`~erase_tune.measure.estimate` (a job's phases from a measured step) and
:mod:`~erase_tune.measure.bench` (``erase-tune bench``).

The statistics (:mod:`~erase_tune.measure.stats`), provenance and the records a trial takes and returns
(:mod:`~erase_tune.measure.records`) need no torch; what times steps on a device is imported on
first use, so the service's read-only commands never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from erase_tune._lazy import lazy_names

from erase_tune.measure.provenance import provenance
from erase_tune.measure.stats import (
    QpsSummary,
    RatioSpread,
    WindowedSamples,
    gain,
    per_step_qps,
    qps_summary,
    ratio_spread,
    t_interval,
)

if TYPE_CHECKING:
    from erase_tune.measure.overlap import (
        KernelInterval,
        OverlapReport,
        kernel_intervals_from_trace,
        merge_intervals,
        overlap_report,
        profile_steps,
    )
    from erase_tune.measure.protocol import GainEstimate, ProtocolHooks, ProtocolResult, Steps, StopRule, measure_gains
    from erase_tune.measure.timing import (
        InterleavedTimings,
        StepRunner,
        Timings,
        time_interleaved,
    )

_LAZY = {
    "KernelInterval": "overlap",
    "OverlapReport": "overlap",
    "kernel_intervals_from_trace": "overlap",
    "merge_intervals": "overlap",
    "overlap_report": "overlap",
    "profile_steps": "overlap",
    "GainEstimate": "protocol",
    "ProtocolHooks": "protocol",
    "ProtocolResult": "protocol",
    "Steps": "protocol",
    "StopRule": "protocol",
    "measure_gains": "protocol",
    "InterleavedTimings": "timing",
    "StepRunner": "timing",
    "Timings": "timing",
    "time_interleaved": "timing",
}
"""What needs torch, by the module it lives in: imported on first use."""

__all__ = [
    "GainEstimate",
    "InterleavedTimings",
    "KernelInterval",
    "OverlapReport",
    "ProtocolResult",
    "ProtocolHooks",
    "Steps",
    "QpsSummary",
    "RatioSpread",
    "StepRunner",
    "StopRule",
    "Timings",
    "WindowedSamples",
    "gain",
    "kernel_intervals_from_trace",
    "measure_gains",
    "merge_intervals",
    "overlap_report",
    "per_step_qps",
    "profile_steps",
    "provenance",
    "qps_summary",
    "ratio_spread",
    "t_interval",
    "time_interleaved",
]

__getattr__ = lazy_names(__name__, _LAZY)
