"""Service fixtures: one real local Ray cluster (separate worker processes) per test session,
the CLI in-process and in a fresh process, and a clean environment for every test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "search_spaces" / "ctr-smoke.yaml"


@pytest.fixture(autouse=True)
def _service_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test reads the developer's storage, Ray address or journal; storage loss is given up
    on quickly."""
    monkeypatch.delenv("ERASE_TUNE_STORAGE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("ERASE_TUNE_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.setenv("ERASE_TUNE_STORAGE_RETRY_S", "3")


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


def run_cli(*argv: object) -> int:
    from erase_tune.cli import main

    return main([str(a) for a in argv])


def cli(*argv: object, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m erase_tune ...`` in a fresh process: what a terminal would show."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "erase_tune", *map(str, argv)], capture_output=True, text=True,
                          env=full, timeout=timeout, cwd=ROOT)


@pytest.fixture
def python() -> str:
    return sys.executable
