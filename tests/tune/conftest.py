"""Service fixtures: one real local Ray cluster (separate worker processes) per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "search_spaces" / "ctr-smoke.yaml"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray: a raylet, a GCS and worker processes, shared by the service tests.

    The executor joins it (it does not start or stop its own when Ray is initialised).
    Worker processes must import erase_tune and the test workloads: put the repo on their path.
    """
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error",
             object_store_memory=256 * 1024**2)
    yield
    ray.shutdown()


def run_cli(*argv: str) -> int:
    from erase_tune.cli import main

    return main([str(a) for a in argv])


@pytest.fixture
def python() -> str:
    return sys.executable
