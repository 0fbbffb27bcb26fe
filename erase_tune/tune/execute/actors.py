"""Warm trial workers: one Ray actor per rank, a group of them per trial slot.

A fresh process per trial cost 3.4 s (interpreter, torch import, CUDA init) on top of a
17.5 s trial. A :class:`WorkerGroup` keeps its processes warm instead and runs its slot's
trials one after another; isolation after a failure is kept by replacing the whole group
(new processes) after a cancelled or lost trial and after any failed trial on CUDA or of
several ranks, so a poisoned CUDA context, a leaked allocation or a half-torn process group
never reaches the next trial. A single-rank CPU worker whose trial failed in Python (a NaN loss,
a refused plan) says it stays fit and runs the next one (``WorkerInfo.reusable``).

A group reserves its resources as one placement group (``gpus_per_trial`` bundles of one
GPU, packed onto one node), so a trial of k ranks gets k GPUs of one host or waits until
the cluster has them (an autoscaling cluster adds GPU nodes for pending placement groups).
Each actor imports erase-tune and the workload's module when it starts: a package that did
not travel to the node shows up here, once, as a clear failure, not as every trial failing.

Ray lowers its worker processes' priority (niceness 15). A trial worker is the job's
measurement, not background work: at niceness 15 any other busy process on the host (another
job, a data loader, a compile) takes nearly all of a core from it, so its host-bound step would
be timed at a fraction of its speed. Trial workers keep the priority they start with
(:data:`WORKER_ENV`; Ray's own job server does the same for a job's driver).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

from erase_tune.errors import first_line
from erase_tune.tune.execute.outcome import ConfirmOutcome, Failure, TrialOutcome, WorkerInfo
from erase_tune.tune.execute.task import (
    ConfirmSpec,
    ReferenceOutcome,
    ReferenceSpec,
    TrialSpec,
    classify,
    run_confirm,
    run_reference,
    run_spec,
)

__all__ = ["TrialWorker", "WorkerGroup", "release"]


class TrialWorker:
    """The Ray actor body (wrapped with ``ray.remote`` by :class:`WorkerGroup`)."""

    def __init__(self, workload: str) -> None:
        self.failure: Failure | None = None
        try:
            import erase_tune.measure.trial  # noqa: F401 - torch and the library, once per process
            from erase_tune.workloads import module_of

            importlib.import_module(module_of(workload))
        except Exception as e:  # noqa: BLE001 - reported by ready(), not by a dead actor
            self.failure = classify(e)

    def ready(self) -> tuple[Failure | None, WorkerInfo]:
        return self.failure, WorkerInfo(**self._where())

    def run(self, spec: TrialSpec, rank: int, world: int, rendezvous: str | None) -> TrialOutcome:
        if self.failure is not None:
            return TrialOutcome(trial_number=spec.trial_number, failure=self.failure)
        if world == 1:
            return run_spec(spec, info=self._where)
        from erase_tune.tune.execute.distributed import run_rank

        return run_rank(spec, rank=rank, world=world, rendezvous=rendezvous, info=self._where)

    def confirm(self, spec: ConfirmSpec, rank: int = 0, world: int = 1, rendezvous: str | None = None) -> ConfirmOutcome:
        if self.failure is not None:
            return ConfirmOutcome(failure=self.failure)
        if world == 1:
            return run_confirm(spec, info=self._where)
        from erase_tune.tune.execute.distributed import run_confirm_rank

        return run_confirm_rank(spec, rank=rank, world=world, rendezvous=rendezvous, info=self._where)

    def reference(self, spec: ReferenceSpec) -> ReferenceOutcome:
        """The job's one try of the whole-step-graph reference (rank 0's GPU alone)."""
        if self.failure is not None:
            return ReferenceOutcome(failure=self.failure)
        return run_reference(spec, info=self._where)

    def address(self) -> str:
        """This node's IP and a free port, for a distributed trial's rendezvous (rank 0)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    @staticmethod
    def _where() -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node": f"{ray.util.get_node_ip_address()}/{ctx.get_node_id()[:12]}",
                "gpu_ids": tuple(str(g) for g in ray.get_gpu_ids()), "pid": os.getpid()}


PLACING_WAIT_S = 2.0
"""How long a slot released while Ray places it waits for the placement before it is removed."""

WORKER_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}
"""A trial worker's runtime environment (merged into the job's): no lowered priority."""


@dataclasses.dataclass(eq=False)
class WorkerGroup:
    """One trial slot: a placement group and one actor per rank, created asynchronously."""

    ranks: int
    use_gpu: bool
    workload: str
    created: float = dataclasses.field(default_factory=time.monotonic)
    state: str = "placing"
    """``placing`` (waiting for resources), ``starting`` (actors importing), ``ready``; ``broken``
    (a worker cannot import erase-tune or the workload: no use retrying) or ``lost``."""
    failure: Failure | None = None
    info: WorkerInfo | None = None
    pg: Any = None
    actors: list[Any] = dataclasses.field(default_factory=list)
    _pending: Any = None

    def __post_init__(self) -> None:
        import ray

        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        self.pg = ray.util.placement_group([bundle] * self.ranks, strategy="STRICT_PACK")
        self._pending = self.pg.ready()

    def poll(self) -> str:
        """Advance the group's start-up without blocking; returns its state."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.state == "placing" and ray.wait([self._pending], timeout=0)[0]:
            cls = ray.remote(TrialWorker)
            for rank in range(self.ranks):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
                self.actors.append(cls.options(num_gpus=1 if self.use_gpu else 0, num_cpus=1, max_restarts=0,
                                               scheduling_strategy=strategy, runtime_env=WORKER_ENV)
                                   .remote(self.workload))
            self._pending = [a.ready.remote() for a in self.actors]
            self.state = "starting"
        if self.state == "starting" and len(ray.wait(self._pending, num_returns=len(self._pending), timeout=0)[0]) \
                == len(self._pending):
            try:
                answers = ray.get(self._pending)
            except Exception as e:  # noqa: BLE001 - an actor lost while starting (its node went away)
                self.failure = Failure(kind="infra", reason=f"trial worker lost while starting: {first_line(e)}")
                self.state = "lost"
            else:
                self.failure = next((f for f, _ in answers if f is not None), None)
                self.info = answers[0][1]
                self.state = "broken" if self.failure else "ready"
        return self.state

    def run(self, spec: TrialSpec) -> Any:
        """Start a trial on every rank; the returned ref resolves to rank 0's outcome."""
        import ray

        rendezvous = ray.get(self.actors[0].address.remote()) if self.ranks > 1 else None
        refs = [a.run.remote(spec, rank, self.ranks, rendezvous) for rank, a in enumerate(self.actors)]
        return refs[0], refs[1:]

    def confirm(self, spec: ConfirmSpec) -> Any:
        """Start a confirmation on every rank; the returned ref resolves to rank 0's outcome."""
        import ray

        if self.ranks == 1:
            return self.actors[0].confirm.remote(spec)
        rendezvous = ray.get(self.actors[0].address.remote())
        refs = [a.confirm.remote(spec, rank, self.ranks, rendezvous) for rank, a in enumerate(self.actors)]
        return refs[0]

    def destroy(self) -> None:
        """Kill the actors and remove the placement group (see :func:`release`, which settles first)."""
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(self.pg)
        self.actors, self.state = [], "broken"


def release(groups: list[WorkerGroup]) -> None:
    """Destroy ``groups``, first letting Ray finish the placements it is making for them.

    Ray may be reserving a placing group's bundles at this moment, and a group removed then can
    leave them reserved: a CPU (or GPU) of the cluster held, with no group left, for as long as
    the cluster lives (ray-project/ray#64693; here about one in 25 groups removed just after they
    were asked for, and seen in the suite when a failed try's slot was replaced and the executor
    closed at once). One wait of at most :data:`PLACING_WAIT_S` covers them all; a group still
    placing after it waits for resources, and nothing of it is reserved."""
    import ray

    placing = [g._pending for g in groups if g.state == "placing"]
    if placing:
        ray.wait(placing, num_returns=len(placing), timeout=PLACING_WAIT_S)
    for g in groups:
        g.destroy()
