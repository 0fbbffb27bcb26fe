"""Service fixtures: one real local Ray cluster (separate worker processes) per test session,
the CLI in-process and in a fresh process, and a clean environment for every test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import start_shared_ray

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
    """A local Ray: a raylet, a GCS and worker processes, shared by the service tests of one test
    process (tests/conftest.py starts it before each test that uses it, and under pytest-xdist
    stops it once the process moves on to files that do not).

    The executor joins it (it does not start or stop its own when Ray is initialised).
    """
    import ray

    start_shared_ray()
    yield
    ray.shutdown()


def _cpus_held(ray: object, wait_s: float) -> float:
    """CPUs of the shared cluster still held after up to ``wait_s`` seconds."""
    total = ray.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    return total - ray.available_resources().get("CPU", 0)


@pytest.fixture(autouse=True)
def _ray_cluster_given_back() -> Iterator[None]:
    """A test on the shared cluster gives back every CPU it took: a placement group left behind
    holds its CPUs, and a later test that needs them waits until its limit (10 minutes) and fails
    for a reason that is not its own. The leak fails the test that left it, and is cleared."""
    yield
    ray = sys.modules.get("ray")  # a test without the fixture may join the cluster in-process too
    if ray is None or not ray.is_initialized():
        return
    total = ray.cluster_resources().get("CPU", 0)
    held = _cpus_held(ray, 30)
    if held <= 0:
        return
    groups = [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
    from ray.util.placement_group import PlacementGroup, PlacementGroupID

    for pg in groups:
        ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg))))
    cleared = "cleared"
    if _cpus_held(ray, 10) > 0:
        # Held by no placement group (seen under load: a group removed while Ray was still reserving
        # it): nothing here can give it back, so the next tests get a new cluster instead of failing too.
        ray.shutdown()
        start_shared_ray()
        cleared = "the shared cluster was started anew"
    what = (f"the test left {held:g} of {total:g} CPU(s) held on the shared Ray cluster "
            f"({len(groups)} placement group(s) not removed; {cleared})")
    if not groups:  # it removed every group it made: Ray kept the CPUs (its leak, not the test's)
        warnings.warn(what, stacklevel=1)
        return
    pytest.fail(what)


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
