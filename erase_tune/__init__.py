"""erase-tune: find where ERASE should cut a model, and run the plan in production training.

The library (``runtime``, ``workloads``, ``measure``, ``trial``) knows nothing of Optuna, Ray
or SQL; the service (``tune``, ``store``, ``cli``) is a thin layer over it.
"""

from erase_tune.errors import CaptureError, EraseTuneError, PlanError, WorkloadError
from erase_tune.runtime import Cut, EraseEngine, ErasePlan, Graphed, Placement

__all__ = ["Cut", "Placement", "Graphed", "ErasePlan", "EraseEngine", "EraseTuneError", "PlanError", "WorkloadError",
           "CaptureError"]
__version__ = "0.1.0"
