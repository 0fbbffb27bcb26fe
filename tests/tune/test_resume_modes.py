"""A job resumed with a space that offers other choices for a parameter its trials were tuned
over (other modes, say): one line naming the space and the study, not Optuna's ValueError
traceback from the first new trial (issue 30). No Ray: the loop's proposal step alone."""

from __future__ import annotations

import types
import warnings

import optuna
import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.tune.run.loop import Loop
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.space import SearchSpace
from tests.hostile_world_30 import TINY_SPACE


def _bound(modes: str):
    text = TINY_SPACE.replace("max_streams: 1}", f"max_streams: 1, modes: {modes}}}")
    return SearchSpace.loads(text, source="resumed.yaml")


@pytest.mark.parametrize("later", ["[keep, place, graph]", "[keep, graph]"])
def test_resuming_with_other_modes_is_one_line(tmp_path, later):
    first = check_space(_bound("[keep, detach]"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="resumed",
                                    directions=["maximize", "minimize"])
    trial = study.ask()
    first.plan(trial)  # the first job's trial: its modes' choices are stored with it
    study.tell(trial, [0.1, 0.0])
    space = _bound(later)
    loop = types.SimpleNamespace(storage=types.SimpleNamespace(heartbeat=lambda _: None),
                                 recorder=types.SimpleNamespace(trial_id=lambda n: n), checked=check_space(space),
                                 space=space, study=study)
    with pytest.raises(EraseTuneError, match="resumed.yaml: offers other choices for a parameter than study 'resumed' "
                                             "was tuned over .*dynamic value space.*use another study name"):
        Loop._propose(loop, study.ask())  # was: ValueError: CategoricalDistribution does not support dynamic ...
