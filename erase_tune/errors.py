"""User-facing errors.

Anything a user can get wrong (a plan file, a workload name, a search space, a storage URL)
raises :class:`EraseTuneError` with one line that names the problem. The CLI prints that line
and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations


class EraseTuneError(Exception):
    """A problem with the user's input, described in one line."""


class PlanError(EraseTuneError, ValueError):
    """An :class:`~erase_tune.runtime.plan.ErasePlan` that is malformed or does not fit its model."""


class WorkloadError(EraseTuneError, ValueError):
    """An unknown workload, a bad workload argument, or data that cannot be read."""


class CaptureError(EraseTuneError, RuntimeError):
    """A workload that cannot be captured in a CUDA graph (dynamic shapes, CPU syncs, ...).

    After a failed capture (not after a shape mismatch at replay) the process's CUDA RNG can
    be left in capture state (seen with torch 2.11: the next ``torch.randn`` on the GPU fails
    with "Offset increment outside graph capture"): restart the process, or train without
    graphs. erase-tune's trial workers are fresh processes, so a study is not affected.
    """
