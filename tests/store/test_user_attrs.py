"""A trial's user attributes written together (``Storage.set_user_attrs``): one transaction, all
or none, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import optuna
import pytest

from erase_tune.store.storage import open_storage


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'attrs.db'}"
    return request.getfixturevalue("pg_url")


def test_several_attributes_are_written_at_once_and_none_to_a_finished_trial(url):
    db = open_storage(url)
    try:
        study = optuna.create_study(study_name="attrs", storage=db.optuna, directions=["maximize", "minimize"],
                                    load_if_exists=True)
        trial = study.ask()
        tid = db.trial_id(db.study_id("attrs"), trial.number)
        db.set_user_attrs(tid, {"a": 1, "b": {"nested": [1, 2]}, "c": "text"})
        db.set_user_attrs(tid, {"a": 2})  # an upsert: the key is written again, not added twice
        assert db.trial(tid).user_attrs == {"a": 2, "b": {"nested": [1, 2]}, "c": "text"}
        study.tell(trial, [1.0, 0.0])
        with pytest.raises(RuntimeError):  # Optuna's UpdateFinishedTrialError
            db.set_user_attrs(tid, {"d": 4, "a": 3})
        assert db.trial(tid).user_attrs == {"a": 2, "b": {"nested": [1, 2]}, "c": "text"}
    finally:
        db.close()
