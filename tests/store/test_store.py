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
    Confirmation,
    ConfirmationRecord,
    Job,
    OutcomeRecord,
    SchemaError,
    Store,
    StoredOutcome,
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


# -- trial outcomes and confirmations --------------------------------------------------


SAMPLES = {"baseline": {"steps_s": [0.010, 0.011, 0.0105], "window": [0, 0, 1]},
           "candidate": {"steps_s": [0.009, 0.0091, 0.0089], "window": [0, 0, 1]}}


def test_record_outcome_round_trip(migrated: Store) -> None:
    job = new_job(migrated)
    o = migrated.record_outcome(job, 3, OutcomeRecord(
        plan_yaml=PLAN, status="complete", attempts=2, node="10.0.0.1/abc", samples=SAMPLES,
        provenance={"device_name": "NVIDIA H200", "torch": "2.11.0"}))
    assert isinstance(o, StoredOutcome)
    assert (o.job_id, o.trial_number, o.status, o.attempts, o.node) == (job.id, 3, "complete", 2, "10.0.0.1/abc")
    assert o.samples == SAMPLES and o.provenance["torch"] == "2.11.0"
    assert o.failure_kind is None and o.traceback is None
    assert migrated.outcome(job, 3) == o
    assert migrated.outcome(job, 4) is None
    assert migrated.latest_provenance(job) == {"device_name": "NVIDIA H200", "torch": "2.11.0"}


def test_record_outcome_is_idempotent(migrated: Store) -> None:
    job = new_job(migrated)
    first = migrated.record_outcome(job, 0, OutcomeRecord(
        plan_yaml=PLAN, status="failed", failure_kind="infra", failure_reason="worker died",
        traceback="Traceback ..."))
    again = migrated.record_outcome(job, 0, OutcomeRecord(
        plan_yaml=PLAN, status="complete", samples=SAMPLES))
    # One row per trial: a replay replaces what was recorded, the row's creation time stays.
    assert again.created_at == first.created_at and again.status == "complete" and again.failure_reason is None
    assert migrated.outcome(job, 0) == again


def test_non_finite_numbers_are_stored_as_null(migrated: Store) -> None:
    # PostgreSQL's jsonb refuses NaN; both backends must store the same thing.
    job = new_job(migrated)
    o = migrated.record_outcome(job, 0, OutcomeRecord(
        plan_yaml=PLAN, status="failed", failure_kind="trial", failure_reason="NaN loss",
        samples={"candidate": {"steps_s": [1.0, float("nan")]}}, provenance={"x": float("inf")}))
    assert o.samples == {"candidate": {"steps_s": [1.0, None]}} and o.provenance == {"x": None}


def test_bad_outcome_arguments(migrated: Store) -> None:
    job = new_job(migrated)
    with pytest.raises(ValueError, match="outcome status"):
        migrated.record_outcome(job, 0, OutcomeRecord(
            plan_yaml=PLAN, status="done"))
    with pytest.raises(ValueError, match="failure kind"):
        migrated.record_outcome(job, 0, OutcomeRecord(
            plan_yaml=PLAN, status="failed", failure_kind="cosmic"))
    with pytest.raises(TypeError, match="provenance"):
        migrated.record_outcome(job, 0, OutcomeRecord(
            plan_yaml=PLAN, status="complete", provenance={"x": object()}))
    assert migrated.outcome(job, 0) is None  # nothing half-written


def test_confirmations_round_trip(migrated: Store) -> None:
    job = new_job(migrated)
    a = migrated.record_confirmation(job, 4, ConfirmationRecord(
        plan_yaml=PLAN, gain_over="graph", windows=5, gain=0.08, gain_lo=0.07, gain_hi=0.09, samples=SAMPLES,
        provenance={"device_name": "NVIDIA H200"}))
    b = migrated.record_confirmation(job, 7, ConfirmationRecord(
        plan_yaml=PLAN, gain_over="graph", windows=5, gain=0.01, gain_lo=-0.01, gain_hi=0.03, samples={},
        provenance={}))
    assert isinstance(a, Confirmation) and (a.trial_number, a.gain_lo, a.windows) == (4, 0.07, 5)
    assert migrated.confirmations(job) == [a, b]


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
    assert store.schema_version().revision is None
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
                mine.record_outcome(job, n, OutcomeRecord(
                    plan_yaml=PLAN, status="complete", provenance={"n": n}, node=f"node-{i}"))

    _in_threads(2, worker)
    assert all(migrated.outcome(job, n).provenance == {"n": n} for n in range(40))


def test_concurrent_retries_of_one_trial_leave_one_row(migrated: Store) -> None:
    """A trial and its retry racing on one shared store: one row, no integrity error."""
    job = new_job(migrated)
    _in_threads(4, lambda i: [migrated.record_outcome(job, n, OutcomeRecord(
        plan_yaml=PLAN, status="complete", provenance={"writer": i})) for n in range(10)])
    assert all(migrated.outcome(job, n) is not None for n in range(10))


def test_concurrent_get_or_create_returns_one_job(migrated: Store) -> None:
    jobs: list[Job] = []
    _in_threads(4, lambda i: jobs.append(new_job(migrated, "shared", get_or_create=True)))
    assert len({j.id for j in jobs}) == 1 and len(migrated.list_jobs()) == 1


# -- URLs ------------------------------------------------------------------------------


def test_default_storage_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ERASE_TUNE_STORAGE", raising=False)
    assert default_storage_url() == "sqlite:///erase-tune.db"
    monkeypatch.setenv("ERASE_TUNE_STORAGE", "postgresql+psycopg://u@db/x")
    assert default_storage_url() == "postgresql+psycopg://u@db/x"


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
