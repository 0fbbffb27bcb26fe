"""A signal while the driver admits a trial, sent deliberately between two of its parameter
writes: the trial is asked, given its whole plan and put in flight before the signal is
raised, so the driver's clean-up fails it and nothing stays RUNNING or half written.

(Sent by timing luck, beside two CPU burners, SIGTERM once landed inside a parameter's write:
the trial stayed RUNNING with half its parameters and no plan.)"""

from __future__ import annotations

import os
import signal

import pytest
from optuna.trial import TrialState

from erase_tune import _signals
from erase_tune.errors import Terminated
from erase_tune.store.optuna_storage import RetryingStorage
from erase_tune.store.storage import open_storage
from erase_tune.tune.run.job import _Job, _set_up
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import Attr
from tests.tune.faulty import write_space


def test_a_signal_between_a_new_trials_parameter_writes_waits_until_it_is_whole_and_in_flight(
        tmp_path, monkeypatch):
    path = write_space(tmp_path / "s.yaml", trials=2)
    space = SearchSpace.load(path)
    db = open_storage(f"sqlite:///{tmp_path / 'admit.db'}")
    written: list[str] = []
    real = RetryingStorage.set_trial_param

    def set_trial_param(self, trial_id, param_name, *args, **kwargs):
        written.append(param_name)
        if len(written) == 1:  # after the first parameter of the first trial, before the next
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, trial_id, param_name, *args, **kwargs)

    monkeypatch.setattr(RetryingStorage, "set_trial_param", set_trial_param)
    # erase-tune's handlers go over the default only: a Ray started in this test process earlier
    # has its own, which exits.
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    restore = _signals.on_signals()
    try:
        # executor None: nothing may reach it (the signal must be raised before the trial is submitted)
        loop = _set_up(_Job(db=db, name="admit", space_path=str(path), target=2, executor=None), space,
                       check_space(space), lambda progress: None)
        with pytest.raises(Terminated):
            loop.admit()
    finally:
        restore()
        signal.signal(signal.SIGTERM, before)
    assert len(written) > 1  # the signal came while the plan was still being written
    (trial,) = db.study("admit").get_trials()
    # Whole (every parameter and its plan written), in flight, and failed by admit's own clean-up.
    assert Attr.PLAN in trial.user_attrs and len(trial.params) == len(written)
    assert [inf.number for inf in loop.inflight] == [trial.number]
    assert trial.state == TrialState.FAIL
    loop.abort("terminated")  # the job's clean-up after it: the trial stays failed, nothing raises
    assert db.study("admit").get_trials()[0].state == TrialState.FAIL
    db.close()
