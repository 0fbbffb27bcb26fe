"""The ERASE runtime: plans (where to cut and place), the probe that checks a plan against its
model, and the engine that trains a model under a plan.

Plans are read without torch (``erase-tune status`` and ``report`` only read them); the engine,
the aux heads and the probe import torch when first used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from erase_tune._lazy import lazy_names

from erase_tune.runtime.plan import (
    DISPATCH_MODES,
    MAX_RUN,
    MAX_STREAMS,
    MAX_TARGETS,
    PLAN_VERSION,
    Cut,
    ErasePlan,
    Graphed,
    Placement,
    targets_overlap,
)

if TYPE_CHECKING:
    from erase_tune.runtime.engine import EraseEngine
    from erase_tune.runtime.heads import LinearHead
    from erase_tune.runtime.probing import ProbeResult, probe

_LAZY = {"EraseEngine": "engine", "LinearHead": "heads", "ProbeResult": "probing", "probe": "probing"}
"""What needs torch, by the module it lives in: imported on first use."""

__all__ = [
    "Cut",
    "Placement",
    "Graphed",
    "ErasePlan",
    "EraseEngine",
    "LinearHead",
    "ProbeResult",
    "probe",
    "targets_overlap",
    "DISPATCH_MODES",
    "PLAN_VERSION",
    "MAX_TARGETS",
    "MAX_STREAMS",
    "MAX_RUN",
]

__getattr__ = lazy_names(__name__, _LAZY)
