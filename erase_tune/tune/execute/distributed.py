"""A data-parallel trial: one Ray actor per rank, one process group per trial.

:class:`~erase_tune.tune.execute.actors.WorkerGroup` places the k actors of a trial slot on one node
(a STRICT_PACK placement group, one GPU each, or one CPU each on the CPU); rank 0 picks the
rendezvous address (its node's IP and a free port). For each trial every rank joins a fresh
process group (nccl on CUDA, gloo on the CPU), runs the same
:func:`~erase_tune.measure.trial.run_trial` with it — baseline, candidate, twin and reference all
data parallel, interleaved as in one process — and leaves the group. The driver keeps rank
0's result; a rank that failed fails the trial (:class:`~erase_tune.tune.execute.executor.RayExecutor`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from erase_tune.tune.execute.outcome import ConfirmOutcome, Failure, TrialOutcome
from erase_tune.tune.execute.task import ConfirmSpec, TrialSpec, run_confirm, run_spec

__all__ = ["COLLECTIVE_TIMEOUT_S", "process_group", "run_confirm_rank", "run_rank"]

COLLECTIVE_TIMEOUT_S = 300
"""A rank waits this long for the others at a collective (a rank lost mid-trial) before failing;
the job's trial timeout usually cancels the trial first."""


@contextlib.contextmanager
def process_group(rank: int, world: int, rendezvous: str, device: str) -> Iterator[Any]:
    """The default process group of ``world`` ranks, met at ``rendezvous`` (``host:port``)."""
    import torch
    import torch.distributed as dist

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run_rank(spec: TrialSpec, *, rank: int, world: int, rendezvous: str | None,
             info: Callable[[], dict[str, Any]] = dict) -> TrialOutcome:
    """Rank ``rank`` of a ``world``-rank trial; never raises for the trial's own failure."""
    try:
        with process_group(rank, world, _address(rendezvous), spec.device) as group:
            return run_spec(spec, info=info, process_group=group)
    except Exception as e:  # noqa: BLE001 - the group could not form (or leave): the node's problem
        return TrialOutcome(trial_number=spec.trial_number, failure=_group_failure(e, rank, world))


def run_confirm_rank(spec: ConfirmSpec, *, rank: int, world: int, rendezvous: str | None,
                     info: Callable[[], dict[str, Any]] = dict) -> ConfirmOutcome:
    """Rank ``rank`` of a ``world``-rank confirmation."""
    try:
        with process_group(rank, world, _address(rendezvous), spec.device) as group:
            return run_confirm(spec, info=info, process_group=group)
    except Exception as e:  # noqa: BLE001
        return ConfirmOutcome(failure=_group_failure(e, rank, world))


def _address(rendezvous: str | None) -> str:
    if not rendezvous:
        raise ValueError("a trial of several ranks needs rank 0's rendezvous address")
    return rendezvous


def _group_failure(e: BaseException, rank: int, world: int) -> Failure:
    text = " ".join(str(e).split())[:300] or type(e).__name__
    return Failure(kind="infra", reason=f"rank {rank} of {world}: process group failed: {text}",
                   traceback=traceback.format_exc(limit=12))
