"""What crosses from a trial worker back to the driver: a typed, frozen outcome.

A worker sends exactly one :class:`TrialOutcome`: the library's own
:class:`~erase_tune.measure.trial.TrialResult` (metrics, per-step samples with their windows,
provenance) or a :class:`Failure` saying what kind of failure it was, why, and the
worker's traceback. Nothing is read back by string keys. The failure kind decides what the
driver does: a ``trial`` failure (invalid plan, NaN, OOM, capture) is the plan's and is
recorded once; an ``infra`` failure (worker died, node lost, a package the worker cannot
import) is the cluster's and is retried before it is recorded.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from erase_tune.measure.records import TrialResult

if TYPE_CHECKING:  # a field's annotation only: reading a stored outcome needs no torch
    from erase_tune.measure.confirm import ConfirmResult

__all__ = ["FailureKind", "Failure", "WorkerInfo", "TrialOutcome", "ConfirmOutcome"]

FailureKind = Literal["trial", "infra"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failure:
    """Why a trial produced no measurement."""

    kind: FailureKind
    reason: str
    """One line, for tables and the study."""
    traceback: str | None = None
    """The worker's traceback, where there was one (not for a killed or lost worker)."""

    def __post_init__(self) -> None:
        if self.kind not in ("trial", "infra"):
            raise ValueError(f"failure kind {self.kind!r} is not 'trial' or 'infra'")
        object.__setattr__(self, "reason", " ".join(str(self.reason).split()) or "unknown")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """Where and when the work ran (worker wall clock)."""

    node: str | None = None
    """``ip/node-id`` of the Ray node."""
    gpu_ids: tuple[str, ...] = ()
    pid: int | None = None
    started_at: float = 0.0
    """The worker began the task."""
    ready_at: float = 0.0
    """Imports and set-up done; the trial itself starts."""
    finished_at: float = 0.0
    reusable: bool = False
    """The process may run the slot's next trial: said by the worker itself, after a success or
    after a failure that left nothing behind (on the CPU: :func:`erase_tune.tune.execute.task.fit_after`).
    An outcome the driver made for a killed, crashed or lost worker leaves it False."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outcome:
    """What every outcome holds: a worker's result or its failure, never both, and where it ran."""

    WHAT: ClassVar[str]
    """What the outcome is of, as its error names it."""
    result: Any = None
    failure: Failure | None = None
    worker: WorkerInfo = dataclasses.field(default_factory=WorkerInfo)

    def __post_init__(self) -> None:
        if (self.result is None) == (self.failure is None):
            raise ValueError(f"a {self.WHAT} outcome holds a result or a failure, exactly one")

    @property
    def complete(self) -> bool:
        return self.result is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialOutcome(_Outcome):
    """One trial's measurement or its failure, never both."""

    WHAT: ClassVar[str] = "trial"
    trial_number: int
    result: TrialResult | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmOutcome(_Outcome):
    """A confirming re-measurement of front plans, or why it could not be made."""

    WHAT: ClassVar[str] = "confirm"
    result: ConfirmResult | None = None
