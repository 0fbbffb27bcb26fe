"""Shared test fixtures: GPU marker handling, global-state hygiene, and the databases.

Storage tests run one suite against SQLite and PostgreSQL (Optuna's STORAGE_MODES style).
PostgreSQL tests are real tests, not skips: CI starts the server. Each test session gets
its own freshly created, uniquely named database (made through the admin database with
AUTOCOMMIT, dropped at the end), so parallel sessions never see each other's tables; each
test then starts from an empty ``public`` schema. ``ERASE_TUNE_TEST_PG_URL`` points the
suite at another server's admin database.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from erase_tune.store import redact_url

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Three test processes (and their children) share two cores: each computes on one thread.
    # torch's default of one thread per core made every process's intra-op threads contend
    # with the others' (a 9 s CPU training fixture took 282 s beside two CPU burners).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


SLOWEST_FIRST = (
    "tests/tune/test_time_honesty.py", "tests/tune/test_service.py", "tests/tune/test_resume_signals.py",
    "tests/tune/test_cli_errors.py", "tests/tune/test_early_stop.py", "tests/tune/test_ray_cluster.py",
    "tests/test_hostile.py", "tests/tune/test_storage_loss.py", "tests/tune/test_drivers.py",
    "tests/tune/test_resume.py", "tests/tune/test_faults.py", "tests/tune/test_screen.py", "tests/test_hostile_ops.py",
    "tests/test_hostile_30.py", "tests/tune/test_noise_service.py", "tests/torchrec/test_workloads_doc.py",
    "tests/tune/test_record_race.py", "tests/tune/test_workloads_doc.py",
)
"""Test files of a minute or more on two cores, longest first. Under pytest-xdist (``-n 3 --dist
loadfile --no-loadscope-reorder``) whole files go to the workers in collection order: these go
first so that no long file starts last and leaves the others idle. A stale entry costs time,
never a result. One process keeps the files' own order."""

RAY_FILES = pytest.StashKey[frozenset[str]]()
"""The test files of which some test uses the shared Ray cluster (``ray_cluster``)."""


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    config.stash[RAY_FILES] = frozenset(_file(item) for item in items if "ray_cluster" in item.fixturenames)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The files on the shared Ray first, so that each test process is done with its Ray early
        # and stops it (pytest_runtest_setup); then the others. Longest first within each.
        rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
        ray_files = config.stash[RAY_FILES]
        items.sort(key=lambda item: (_file(item) not in ray_files, rank.get(_file(item), len(rank))))  # stable
    if os.environ.get("ERASE_TUNE_LOAD_TESTS") != "1":
        load = pytest.mark.skip(reason="a load test of minutes: run with ERASE_TUNE_LOAD_TESTS=1")
        for item in items:
            if "load" in item.keywords:
                item.add_marker(load)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The shared Ray cluster (``ray_cluster``) is started before a test that uses it, and under
    pytest-xdist stopped at the first test of a file that does not: an idle local Ray takes about
    1.7 CPU-s a minute (its raylet, GCS, agents and monitors poll), which every test process paid
    for the whole run while their files on Ray came and went. The files on Ray run first
    (pytest_collection_modifyitems), so each process stops it once."""
    ray = sys.modules.get("ray")
    if "ray_cluster" in item.fixturenames:
        start_shared_ray()
    elif (os.environ.get("PYTEST_XDIST_WORKER") and ray is not None and ray.is_initialized()
          and _file(item) not in item.config.stash[RAY_FILES]):
        ray.shutdown()


def start_shared_ray() -> None:
    """Start this test process's shared local Ray, unless Ray is up. Its worker processes must
    import erase_tune and the test workloads: the repository goes on their path."""
    import ray

    from erase_tune.tune.execute.executor import LOCAL_RAY_CONFIG

    if ray.is_initialized():
        return
    root = str(Path(__file__).resolve().parents[1])
    if root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error",
             object_store_memory=256 * 1024**2, _system_config=LOCAL_RAY_CONFIG)


def pytest_collection_finish(session):
    """Move everything imported and collected so far (torch, the test modules, hypothesis) out of
    the collector's reach: a trial ends with a full ``gc.collect()`` (it hands an engine's memory
    back), which in a test process otherwise walks that whole heap, about 0.3 s each time."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Tests may change global torch state (default dtype, seeds, threads); put it back."""
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


PG_ADMIN_URL = os.environ.get("ERASE_TUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
STORAGE_MODES = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """URL of a PostgreSQL database created for this test session and dropped after it."""
    name = f"erase_tune_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except OperationalError as exc:
        pytest.fail(
            f"PostgreSQL at {redact_url(PG_ADMIN_URL)} is needed by the store tests and is not reachable "
            f"({' '.join(str(exc.orig).split())}); start it, or set ERASE_TUNE_TEST_PG_URL",
            pytrace=False,
        )
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            # FORCE: a connection a failed test leaked must not keep the database alive.
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def pg_url(pg_database: str) -> str:
    """The session's PostgreSQL database, emptied, so every test starts from nothing."""
    engine = create_engine(pg_database, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()
    return pg_database


@pytest.fixture(params=STORAGE_MODES)
def storage_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty database of each supported kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'erase-tune.db'}"
    return request.getfixturevalue("pg_url")
