"""The storage API, the same tests on SQLite and PostgreSQL; URL errors and redaction."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import threading

import pytest
from sqlalchemy.engine import make_url

from erase_tune.errors import EraseTuneError
from erase_tune.store import (
    Job,
    SchemaError,
    Store,
    TrialMeasurement,
    baseline_key,
    default_storage_url,
    redact_url,
)

SPACE = "cuts:\n  - module: subarchs.0\n"
PLAN = "version: 1\ncuts: []\n"


def new_job(store: Store, name: str = "study-a", **kw) -> Job:
    kw.setdefault("settings", {"sampler": "tpe", "seed": 0, "budget": {"steps": 200}})
    return store.create_job(study_name=name, space_path="spaces/ctr.yaml", space_yaml=SPACE, workload="ctr", **kw)


# -- jobs ------------------------------------------------------------------------------


def test_create_get_list_jobs(migrated: Store) -> None:
    a = new_job(migrated, "a", n_trials_target=50)
    b = new_job(migrated, "b")
    assert isinstance(a, Job) and a.status == "running" and a.error is None and a.finished_at is None
    assert a.settings == {"sampler": "tpe", "seed": 0, "budget": {"steps": 200}}
    assert a.space_yaml == SPACE and a.n_trials_target == 50 and b.n_trials_target is None
    assert a.created_at.tzinfo is not None and a.created_at.utcoffset() == dt.timedelta(0)
    assert migrated.get_job("a") == a
    assert migrated.get_job("nope") is None
    assert [j.study_name for j in migrated.list_jobs()] == ["a", "b"]


def test_duplicate_study_name_is_a_one_line_error_unless_get_or_create(migrated: Store) -> None:
    first = new_job(migrated)
    with pytest.raises(EraseTuneError, match="already exists") as info:
        new_job(migrated, settings={"other": 1})
    assert "\n" not in str(info.value)
    again = new_job(migrated, settings={"other": 1}, get_or_create=True)
    assert again == first  # the existing job, unchanged
    assert len(migrated.list_jobs()) == 1


def test_set_job_status(migrated: Store) -> None:
    new_job(migrated)
    failed = migrated.set_job_status("study-a", "failed", error="Ray cluster lost")
    assert failed.status == "failed" and failed.error == "Ray cluster lost"
    assert failed.finished_at is not None and failed.updated_at >= failed.created_at
    resumed = migrated.set_job_status("study-a", "running")
    assert resumed.status == "running" and resumed.error is None and resumed.finished_at is None
    assert migrated.get_job("study-a") == resumed
    with pytest.raises(EraseTuneError, match="no job named 'ghost'"):
        migrated.set_job_status("ghost", "finished")
    with pytest.raises(ValueError, match="not one of"):
        migrated.set_job_status("study-a", "exploded")


def test_value_objects_are_frozen(migrated: Store) -> None:
    job = new_job(migrated)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.status = "finished"  # type: ignore[misc]
    # The JSON fields are copies: changing them changes nothing stored.
    job.settings["seed"] = 99
    assert migrated.get_job("study-a").settings["seed"] == 0


# -- trials ----------------------------------------------------------------------------


METRICS = {
    "p90_qps": {"baseline": 1000.0, "candidate": 1200.5, "reference": 1150.0, "detach_only": 1190.0},
    "median_qps": {"baseline": 950.0, "candidate": 1100.0, "reference": 1090.0, "detach_only": 1095.0},
    "ne": {"baseline": 0.81, "candidate": 0.815},
    "gain": {"vs_baseline": 1.2005, "vs_reference": 1.044},
}


def test_record_trial_round_trip(migrated: Store) -> None:
    job = new_job(migrated)
    samples = {"baseline": [1000.0, 990.5, 1010.25], "candidate": [1200, 1190, 1210]}
    t = migrated.record_trial(job, 3, plan_yaml=PLAN, status="complete", metrics=METRICS, samples=samples,
                              device="NVIDIA H200", ray_node="node-1", duration_s=42.5)
    assert isinstance(t, TrialMeasurement)
    assert (t.job_id, t.trial_number, t.status, t.device, t.ray_node, t.duration_s) == (
        job.id, 3, "complete", "NVIDIA H200", "node-1", 42.5)
    assert t.metrics == METRICS
    assert t.samples == {"baseline": [1000.0, 990.5, 1010.25], "candidate": [1200.0, 1190.0, 1210.0]}
    assert all(isinstance(x, float) for x in t.samples["candidate"])
    assert migrated.trial_measurements(job) == [t]


def test_record_trial_is_idempotent(migrated: Store) -> None:
    job = new_job(migrated)
    first = migrated.record_trial(job, 0, plan_yaml=PLAN, status="failed", failure_reason="worker died")
    retry = migrated.record_trial(job, 0, plan_yaml=PLAN, status="complete", metrics=METRICS,
                                  samples={"baseline": [1.0]})
    again = migrated.record_trial(job, 0, plan_yaml=PLAN, status="complete", metrics=METRICS,
                                  samples={"baseline": [1.0]})
    # One row per trial: the retry replaced what was measured, the row's identity stayed.
    assert retry.id == first.id == again.id and retry.created_at == first.created_at
    assert retry.status == "complete" and retry.failure_reason is None and retry.metrics == METRICS
    assert migrated.trial_measurements(job) == [again]


def test_trials_are_per_job_and_ordered(migrated: Store) -> None:
    a, b = new_job(migrated, "a"), new_job(migrated, "b")
    for n in (2, 0, 1):
        migrated.record_trial(a, n, plan_yaml=PLAN, status="pruned")
    migrated.record_trial(b, 0, plan_yaml=PLAN, status="complete")
    assert [t.trial_number for t in migrated.trial_measurements(a)] == [0, 1, 2]
    assert [t.job_id for t in migrated.trial_measurements(b)] == [b.id]


def test_non_finite_numbers_are_stored_as_null(migrated: Store) -> None:
    # PostgreSQL's jsonb refuses NaN; both backends must store the same thing.
    job = new_job(migrated)
    t = migrated.record_trial(job, 0, plan_yaml=PLAN, status="failed", failure_reason="NaN loss",
                              metrics={"ne": float("nan"), "gain": float("inf")},
                              samples={"candidate": [1.0, float("nan")]})
    assert t.metrics == {"ne": None, "gain": None} and t.samples == {"candidate": [1.0, None]}
    assert migrated.trial_measurements(job)[0].metrics == {"ne": None, "gain": None}


def test_bad_trial_arguments(migrated: Store) -> None:
    job = new_job(migrated)
    with pytest.raises(ValueError, match="trial status"):
        migrated.record_trial(job, 0, plan_yaml=PLAN, status="done")
    with pytest.raises(ValueError, match="trial_number"):
        migrated.record_trial(job, -1, plan_yaml=PLAN, status="complete")
    with pytest.raises(TypeError, match="metrics"):
        migrated.record_trial(job, 0, plan_yaml=PLAN, status="complete", metrics={"x": object()})
    assert migrated.trial_measurements(job) == []  # nothing half-written


# -- baseline cache and exports --------------------------------------------------------


def test_baseline_key_is_canonical() -> None:
    k = baseline_key("ctr", {"batch": 8192, "width": 256}, "NVIDIA H200", "2.11.0")
    assert len(k) == 64 and int(k, 16) >= 0
    assert baseline_key("ctr", {"width": 256, "batch": 8192}, "NVIDIA H200", "2.11.0") == k
    assert baseline_key("ctr", {"batch": 8192, "width": 512}, "NVIDIA H200", "2.11.0") != k
    assert baseline_key("ctr", {"batch": 8192, "width": 256}, "NVIDIA H100", "2.11.0") != k
    assert baseline_key("ctr", {"batch": 8192, "width": 256}, "NVIDIA H200", "2.12.0") != k
    assert baseline_key("gpt", {"batch": 8192, "width": 256}, "NVIDIA H200", "2.11.0") != k


def test_baseline_cache_round_trip(migrated: Store) -> None:
    key = baseline_key("ctr", {"batch": 8192}, "cpu", "2.13.0")
    assert migrated.get_baseline(key) is None
    put = migrated.put_baseline(key, {"p90_qps": 1000.0, "median_qps": 950.0}, {"baseline": [1.0, 2.0]})
    got = migrated.get_baseline(key)
    assert got == put and got.metrics == {"p90_qps": 1000.0, "median_qps": 950.0}
    assert got.samples == {"baseline": [1.0, 2.0]}
    # A re-measurement replaces the entry rather than failing on the unique key.
    migrated.put_baseline(key, {"p90_qps": 1010.0}, {"baseline": [3.0]})
    assert migrated.get_baseline(key).metrics == {"p90_qps": 1010.0}


def test_record_export(migrated: Store) -> None:
    job = new_job(migrated)
    e = migrated.record_export(job, 7, "/plans/best.yaml", PLAN)
    assert (e.job_id, e.trial_number, e.path, e.plan_yaml) == (job.id, 7, "/plans/best.yaml", PLAN)
    e2 = migrated.record_export(job, 7, "/plans/best-again.yaml", PLAN)
    assert migrated.exports(job) == [e, e2]


# -- schema guard ----------------------------------------------------------------------


def test_unmigrated_database_is_reported_clearly(store: Store) -> None:
    assert store.current_revision() is None
    with pytest.raises(SchemaError) as info:
        store.check_schema()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("database at revision none")
    assert f"run `erase-tune db upgrade --storage {store.url}`" in message
    # Reads and writes say the same, not "no such table".
    with pytest.raises(SchemaError, match="erase-tune db upgrade"):
        store.list_jobs()


# -- concurrency -----------------------------------------------------------------------


def _in_threads(n: int, fn) -> None:
    barrier, errors = threading.Barrier(n), []

    def run(i: int) -> None:
        try:
            barrier.wait()
            fn(i)
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_concurrent_writers_all_land(migrated: Store, storage_url: str) -> None:
    """Two workers (own stores, own connections) record different trials of one job."""
    job = new_job(migrated)

    def worker(i: int) -> None:
        with Store(storage_url) as mine:
            for n in range(i, 40, 2):
                mine.record_trial(job, n, plan_yaml=PLAN, status="complete", metrics={"n": n},
                                  samples={"candidate": [float(n)]}, ray_node=f"node-{i}")

    _in_threads(2, worker)
    trials = migrated.trial_measurements(job)
    assert [t.trial_number for t in trials] == list(range(40))
    assert all(t.metrics == {"n": t.trial_number} for t in trials)


def test_concurrent_retries_of_one_trial_leave_one_row(migrated: Store) -> None:
    """A trial and its retry racing on one shared store: one row, no integrity error."""
    job = new_job(migrated)
    _in_threads(4, lambda i: [migrated.record_trial(job, n, plan_yaml=PLAN, status="complete",
                                                     metrics={"writer": i}) for n in range(10)])
    trials = migrated.trial_measurements(job)
    assert [t.trial_number for t in trials] == list(range(10))


def test_concurrent_get_or_create_returns_one_job(migrated: Store) -> None:
    jobs: list[Job] = []
    _in_threads(4, lambda i: jobs.append(new_job(migrated, "shared", get_or_create=True)))
    assert len({j.id for j in jobs}) == 1 and len(migrated.list_jobs()) == 1


# -- URLs ------------------------------------------------------------------------------


def test_default_storage_url() -> None:
    assert default_storage_url() == "sqlite:///erase-tune.db"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://tuner:hunter2@db:5432/et", "postgresql+psycopg://tuner:***@db:5432/et"),
        ("postgresql+psycopg://tuner@db/et?password=hunter2&sslmode=require",
         "postgresql+psycopg://tuner@db/et?password=***&sslmode=require"),
        ("sqlite:///erase-tune.db", "sqlite:///erase-tune.db"),
        ("postgresql+psycopg://tuner:hunter2@db:notaport/et", "postgresql+psycopg://tuner:***@db:notaport/et"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


BAD_URLS = [
    pytest.param("", "storage URL is empty", id="empty"),
    pytest.param("just some words", "cannot parse storage URL", id="unparseable"),
    pytest.param("postgresql+psycopg://tuner:hunter2@db:notaport/et", "cannot parse", id="bad-port"),
    pytest.param("nosuchdb://tuner:hunter2@db/et", "unknown database driver 'nosuchdb'", id="unknown-dialect"),
    pytest.param("postgresql+nosuchdriver://tuner:hunter2@db/et", "unknown database driver", id="unknown-driver"),
    pytest.param("mysql://tuner:hunter2@db/et", "'mysql' .* is not supported", id="unsupported-backend"),
    pytest.param("postgresql+asyncpg://tuner:hunter2@db/et", "async driver", id="async-driver"),
]


@pytest.mark.parametrize(("url", "match"), BAD_URLS)
def test_bad_url_is_one_line_without_password(url: str, match: str) -> None:
    with pytest.raises(EraseTuneError, match=match) as info:
        Store(url)
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("postgresql+psycopg://tuner:hunter2@127.0.0.1:1/et", id="no-server"),
        pytest.param("postgresql+psycopg://tuner@127.0.0.1:1/et?password=hunter2", id="no-server-query-password"),
        pytest.param("sqlite:////nonexistent-dir/x.db", id="sqlite-missing-dir"),
    ],
)
def test_unreachable_database_is_one_line_without_password(url: str) -> None:
    store = Store(url)  # lazy: nothing connects yet
    for action in (store.upgrade, store.check_schema, store.list_jobs):
        with pytest.raises(EraseTuneError, match="cannot connect to database") as info:
            action()
        message = str(info.value)
        assert "\n" not in message
        assert "hunter2" not in message and redact_url(url) in message


def test_missing_postgres_database_is_one_line_without_password(pg_database: str) -> None:
    url = make_url(pg_database).set(database="erase_tune_no_such_db", password="hunter2")
    store = Store(url.render_as_string(hide_password=False))
    with pytest.raises(EraseTuneError, match="cannot connect.*does not exist") as info:
        store.upgrade()
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)
    assert "***" in str(info.value)


def test_missing_driver_module_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pg8000", None)  # as if not installed
    store = Store("postgresql+pg8000://tuner:hunter2@db/et")
    with pytest.raises(EraseTuneError, match="cannot load the database driver") as info:
        store.list_jobs()
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)
