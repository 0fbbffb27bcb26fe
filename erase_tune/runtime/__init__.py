"""The ERASE runtime: plans (where to cut and place), the probe that checks a plan against its
model, and the engine that trains a model under a plan."""

from erase_tune.runtime.engine import EraseEngine, LinearHead
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
from erase_tune.runtime.probe import ProbeResult, probe

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
