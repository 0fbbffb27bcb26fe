"""erase-tune: find where ERASE should cut a model, and run the plan in production training.

The library (``runtime``, ``workloads``, ``measure``) knows nothing of Optuna, Ray
or SQL; the service (``tune``, ``store``, ``cli``) is a thin layer over it.
"""

import importlib
from typing import Any

from erase_tune.errors import CaptureError, EraseTuneError, PlanError, WorkloadError

__all__ = ["Cut", "Placement", "Graphed", "ErasePlan", "EraseEngine", "EraseTuneError", "PlanError", "WorkloadError",
           "CaptureError"]
__version__ = "0.1.0"

_RUNTIME = frozenset({"Cut", "Placement", "Graphed", "ErasePlan", "EraseEngine"})


def __getattr__(name: str) -> Any:
    # The runtime (and with it torch, seconds to import) is loaded on first use: the CLI's
    # signal handling is in place by then, so Ctrl-C during that import is one line, not a
    # traceback; `from erase_tune import ErasePlan` works as before.
    if name in _RUNTIME:
        value = getattr(importlib.import_module("erase_tune.runtime"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'erase_tune' has no attribute {name!r}")
