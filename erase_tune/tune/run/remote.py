"""The executor ``export`` confirms a front on, when the job's own confirmation is missing.

The confirmation must run where the trials ran (a GPU study's front cannot be re-measured on
a laptop's CPU), so ``export`` starts or joins Ray exactly as ``start`` does, with the
space the job stored, and runs the confirmation on one worker group (of the space's
``gpus_per_trial`` ranks, as its trials ran).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from erase_tune.errors import EraseTuneError
from erase_tune.store import Job
from erase_tune.tune.execute.executor import RayExecutor, runtime_env
from erase_tune.tune.search.space import SearchSpace

__all__ = ["confirming_executor"]


def confirming_executor(address: str | None, working_dir: str | None, py_modules: Sequence[str],
                        on_ray_started: Callable[[], None] | None = None) -> Callable[[Job | None], Any]:
    """A factory ``export`` calls with the job: a context giving (executor, space).
    ``on_ray_started``: as :class:`RayExecutor` takes it (the CLI puts its SIGTERM handler back)."""

    @contextlib.contextmanager
    def open_for(job: Job | None) -> Iterator[tuple[RayExecutor, SearchSpace]]:
        if job is None:
            raise EraseTuneError("this study has no erase-tune job (its search space is unknown), so its front "
                                 "cannot be re-measured")
        space = SearchSpace.loads(job.space_yaml, source=job.space_path, base=Path(job.space_path).parent)
        env = runtime_env(working_dir or space.workload.working_dir, [*space.workload.py_modules, *py_modules])
        executor = RayExecutor(address, workload=space.workload.name, slots=1, device=space.device,
                               gpus_per_trial=space.gpus_per_trial, runtime_env=env, on_ray_started=on_ray_started)
        try:
            yield executor, space
        finally:
            executor.close()

    return open_for
