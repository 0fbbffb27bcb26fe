"""Optuna's storage with erase-tune's retries: every storage call a study makes is retried.

:class:`RetryingStorage` is an ``optuna.storages.BaseStorage`` (and ``BaseHeartbeat``: Optuna's
heartbeat and ``fail_stale_trials`` work through it) that delegates each call to the storage
Optuna itself would use for an ``RDBStorage`` (its trial cache over the RDB storage), through
the storage's :class:`~erase_tune.store.retry.Retrier`. Studies opened on it
(``optuna.create_study(storage=db.optuna)``) therefore retry ``ask``, ``tell``, attribute
writes and reads once, here, and their callers call them plainly.

Repeating a call is safe for every method (reads, attribute writes, parameter writes and
heartbeats overwrite), except:

- ``set_trial_state_values`` to a finished state: a retry after a commit whose answer was lost
  finds the trial finished (``UpdateFinishedTrialError``); when it holds the state and values
  asked for, the earlier attempt is what finished it, and the call succeeds.
- ``create_new_trial`` (and the WAITING → RUNNING move of an enqueued trial in ``ask``): a
  retry after such a commit leaves one more RUNNING trial with no plan behind, which
  :meth:`erase_tune.tune.run.loop.Loop.maintain` fails once it is older than the grace period
  (the same trial a driver that dies while asking leaves).
- ``create_new_study``: a retry after such a commit raises ``DuplicatedStudyError``, which
  ``optuna.create_study(load_if_exists=True)`` (all erase-tune uses) answers by loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages._heartbeat import BaseHeartbeat  # Optuna's heartbeat contract has no public name
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from erase_tune.store.retry import Retrier

if TYPE_CHECKING:
    from optuna.study._frozen import FrozenStudy  # a type Optuna names only privately

__all__ = ["RetryingStorage"]


class RetryingStorage(optuna.storages.BaseStorage, BaseHeartbeat):
    """``rdb`` behind Optuna's trial cache, every call retried by ``retry`` (see the module docstring)."""

    def __init__(self, rdb: optuna.storages.RDBStorage, retry: Retrier) -> None:
        self.rdb = rdb
        """Optuna's RDB storage itself (its engine, heartbeat settings): calls to it are not retried."""
        self.retry = retry
        self._inner = optuna.storages.get_storage(rdb)  # what a study would wrap an RDBStorage in

    # -- studies -----------------------------------------------------------------------------

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.retry("creating the study", lambda: self._inner.create_new_study(directions, study_name))

    def delete_study(self, study_id: int) -> None:
        self.retry("deleting a study", lambda: self._inner.delete_study(study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self.retry("writing the study's attributes", lambda: self._inner.set_study_user_attr(study_id, key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self.retry("writing the study's attributes", lambda: self._inner.set_study_system_attr(study_id, key, value))

    def get_study_id_from_name(self, study_name: str) -> int:
        return self.retry("reading the study", lambda: self._inner.get_study_id_from_name(study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.retry("reading the study", lambda: self._inner.get_study_name_from_id(study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self.retry("reading the study", lambda: self._inner.get_study_directions(study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self.retry("reading the study", lambda: self._inner.get_study_user_attrs(study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self.retry("reading the study", lambda: self._inner.get_study_system_attrs(study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        return self.retry("listing the studies", self._inner.get_all_studies)

    # -- trials ------------------------------------------------------------------------------

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self.retry("asking for a trial", lambda: self._inner.create_new_trial(study_id, template_trial))

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self.retry("writing a trial's parameters", lambda: self._inner.set_trial_param(
            trial_id, param_name, param_value_internal, distribution))

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        attempts = 0

        def once() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                return self._inner.set_trial_state_values(trial_id, state=state, values=values)
            except optuna.exceptions.UpdateFinishedTrialError:
                if attempts > 1 and state.is_finished() and self._finished_as(trial_id, state, values):
                    return True  # the attempt whose answer was lost finished it
                raise

        return self.retry("recording a trial's state", once)

    def _finished_as(self, trial_id: int, state: TrialState, values: Sequence[float] | None) -> bool:
        stored = self.rdb.get_trial(trial_id)
        return stored.state == state and (values is None or list(stored.values or []) == list(values))

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self.retry("writing a trial's intermediate value",
                   lambda: self._inner.set_trial_intermediate_value(trial_id, step, intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.retry("writing a trial's attributes", lambda: self._inner.set_trial_user_attr(trial_id, key, value))

    def set_trial_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Several user attributes in one transaction: one commit per trial's outcome, not one
        per key (a trial writes about 25). Through Optuna's RDB storage's own upsert of one
        attribute; key by key where this Optuna has none."""
        write = getattr(self.rdb, "_set_trial_attr_without_commit", None)
        try:
            from optuna.storages._rdb import models
            from optuna.storages._rdb.storage import _create_scoped_session
        except ImportError:
            write = None
        if write is None or not hasattr(self.rdb, "scoped_session"):
            for key, value in attrs.items():
                self.set_trial_user_attr(trial_id, key, value)
            return

        def once() -> None:
            with _create_scoped_session(self.rdb.scoped_session, True) as session:
                for key, value in attrs.items():
                    write(session, models.TrialUserAttributeModel, trial_id, key, value)

        self.retry("writing a trial's attributes", once)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.retry("writing a trial's attributes", lambda: self._inner.set_trial_system_attr(trial_id, key, value))

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self.retry("reading the study", lambda: self._inner.get_trial_id_from_study_id_trial_number(
            study_id, trial_number))

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self.retry("reading a trial", lambda: self._inner.get_trial(trial_id))

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self.retry("reading the study", lambda: self._inner.get_all_trials(study_id, deepcopy, states))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self.retry("reading the study", lambda: self._inner.get_best_trial(study_id))

    def remove_session(self) -> None:
        self._inner.remove_session()

    # -- heartbeats (Optuna's BaseHeartbeat) ---------------------------------------------------

    def record_heartbeat(self, trial_id: int) -> None:
        self.retry("keeping heartbeats", lambda: self.rdb.record_heartbeat(trial_id))

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:  # Optuna's own (abstract) name
        return self.retry("keeping heartbeats", lambda: self.rdb._get_stale_trial_ids(study_id))

    def get_heartbeat_interval(self) -> int | None:
        return self.rdb.get_heartbeat_interval()

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        return self.rdb.get_heartbeat_stale_trial_callback()
