"""What a trial worker runs: a plain, picklable spec in, a plain outcome dict out.

This is the seam between the service and the library: a Ray task (or anything else) calls
:func:`run_spec` in a fresh process; it builds the workload, runs
:func:`erase_tune.trial.run_trial` and turns every way a trial can go wrong (bad plan, NaN,
capture failure, CUDA OOM, any exception) into ``{"status": "failed", "reason": ...}``, so a
broken trial is recorded, not fatal.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Mapping
from typing import Any

__all__ = ["TrialSpec", "run_spec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """Everything a worker needs; plain data so it pickles across processes."""

    trial_number: int
    workload: str
    workload_args: Mapping[str, Any]
    plan: Mapping[str, Any]
    budget: Mapping[str, Any]
    device: str = "auto"
    baseline_ne: float | None = None


def run_spec(spec: TrialSpec) -> dict[str, Any]:
    """Run one trial; never raises for a trial's own failure.

    The outcome carries wall-clock stamps (``started_at``: the worker began; ``ready_at``:
    imports done; ``finished_at``) so the driver can split scheduling overhead from the trial.
    """
    started_at = time.time()
    started = time.perf_counter()
    ready_at = None
    try:
        from erase_tune.runtime import ErasePlan
        from erase_tune.trial import Budget, run_trial
        from erase_tune.workloads import get_workload

        ready_at = time.time()
        plan = ErasePlan.from_dict(dict(spec.plan))
        workload = get_workload(spec.workload, dict(spec.workload_args))
        result = run_trial(workload, plan, Budget(**spec.budget), device=spec.device, baseline_ne=spec.baseline_ne)
    except Exception as e:  # noqa: BLE001 - every failure is data for the study
        reason = _reason(e)
        return {"status": "failed", "reason": reason, "duration_s": time.perf_counter() - started,
                "traceback": traceback.format_exc(limit=8), "started_at": started_at,
                "ready_at": ready_at or time.time(), "finished_at": time.time()}
    return {
        "status": "complete",
        "metrics": result.metrics(),
        "samples": {name: list(v.steps_s) for name, v in result.variants.items()},
        "provenance": dict(result.provenance),
        "device": result.provenance.get("device_name"),
        "duration_s": time.perf_counter() - started,
        "started_at": started_at,
        "ready_at": ready_at,
        "finished_at": time.time(),
    }


def _reason(e: BaseException) -> str:
    import torch

    from erase_tune.errors import EraseTuneError

    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return f"CUDA out of memory: {text[:300]}"
    if isinstance(e, EraseTuneError):
        return text
    return f"{type(e).__name__}: {text[:300]}"
