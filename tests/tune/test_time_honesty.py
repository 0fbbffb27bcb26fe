"""A job says what it will cost before trial 0, ends within ``--time-budget`` with everything it
measured kept, and an exact-only space never pays for the NE noise floor or for NE training.

Real jobs on the CPU smoke space through the session's local Ray, stored in SQLite."""

from __future__ import annotations

import logging
import re
import time

import optuna
import pytest

from erase_tune.measure.estimate import PHASE_LIMIT_FACTOR, PHASE_LIMIT_FLOOR_S, phase_limit
from erase_tune.store import Store
from erase_tune.tune.run.job import JobSpec, Where, start_job
from erase_tune.tune.search.study import Attr, measured
from tests.tune.conftest import SMOKE, run_cli

EXACT_ONLY = """
  modes: [keep, place]
"""


@pytest.fixture
def log_text(caplog):
    """The job's log lines, in order (attached to erase-tune's logger itself: an earlier CLI test
    in this process may have stopped it from propagating to the root logger)."""
    logger = logging.getLogger("erase_tune")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield lambda: caplog.text
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def _say(progress) -> None:
    """The progress lines in the log, in order with the job's own lines (as ``erase-tune start`` shows them)."""
    logging.getLogger("erase_tune").info(progress.message)


def _space(tmp_path, modes: str, **budget: object) -> str:
    """The smoke space with ``modes``, no seeds and ``budget`` (a fixed 4 windows unless given: a
    loaded machine's noise would time each trial on to 20)."""
    budget = {"max_windows": 4, **budget}
    text = SMOKE.read_text()
    text = text.replace("  modes: [keep, place, detach]\n", modes)
    head, _, _ = text.partition("\nseeds:")  # no seeds: the screen and the sampler find the plans
    for key, value in budget.items():  # the smoke space's own value for the field is replaced
        head, count = re.subn(rf"\b{key}: [^,}}]+", f"{key}: {value}", head)
        if not count:
            head = head.replace("budget: {", f"budget: {{{key}: {value}, ", 1)
    path = tmp_path / "space.yaml"
    path.write_text(head + "\n")
    return str(path)


def test_an_exact_only_space_measures_no_noise_floor_and_trains_nothing_for_ne(ray_cluster, tmp_path, log_text):
    url = f"sqlite:///{tmp_path / 'exact.db'}"
    summary = start_job(_space(tmp_path, EXACT_ONLY), what=JobSpec(study_name="exact", trials=4, confirm_windows=0),
                        where=Where(storage=url, slots=1), on_progress=_say)
    assert summary.complete == 4 and summary.noise_band == 0.0
    text = log_text()
    assert "noise floor" not in text
    study = optuna.load_study(study_name="exact", storage=url)
    assert Attr.NOISE_FLOOR not in study.user_attrs
    trials = measured(study)
    # Every plan is exact (placements only), checked against the baseline's gradients: NE gap 0,
    # and no step was spent training for NE (the trial trained only its warm-up, its windows and
    # the exactness check's one step).
    assert all(t.user_attrs[Attr.EXACT] is True and t.values[1] == 0.0 for t in trials)
    with Store(url) as store:
        job = store.get_job("exact")
        for t in trials:
            row = store.outcome(job, t.number)
            budget = row.provenance["budget"]
            assert row.provenance["training_steps"] <= budget["warmup_steps"] + budget["max_windows"] * budget[
                "window_steps"] + 1
    # The estimate came before trial 0, from a measured step.
    first_trial = text.index("trial 0:")
    assert text.index("estimate: screen (") < first_trial and "from a measured step of" in text


def test_a_space_that_can_cut_measures_its_noise_floor_only_when_a_cut_runs(ray_cluster, tmp_path, log_text):
    url = f"sqlite:///{tmp_path / 'cuts.db'}"
    start_job(_space(tmp_path, "  modes: [keep, place, detach]\n"), what=JobSpec(study_name="cuts", trials=8,
                                                                                 confirm_windows=0),
              where=Where(storage=url, slots=1), on_progress=_say)
    text = log_text()
    study = optuna.load_study(study_name="cuts", storage=url)
    first_cut = min(t.number for t in measured(study) if t.user_attrs[Attr.PLAN].get("cuts"))
    assert first_cut > 0  # the screen runs the exact plans first
    assert text.index(f"trial {first_cut - 1}:") < text.index("noise floor: training the baseline") \
        < text.index(f"trial {first_cut}:")
    assert Attr.NOISE_FLOOR in study.user_attrs
    # Its limit comes from its estimate (a few times it, at least five minutes), not from the
    # space's per-trial timeout times the runs (an hour here).
    said = re.search(r"measuring the NE gap's noise floor on one trial slot: about (\S+), stopped after (\S+) at most",
                     text)
    assert said and said.group(2) == "5m00s", text


def test_a_phase_is_stopped_after_a_few_times_its_estimate():
    assert phase_limit(None, 3600.0) == 3600.0  # nothing estimated: the safety limit
    assert phase_limit(10.0, 3600.0) == PHASE_LIMIT_FLOOR_S  # never sooner than the floor
    assert phase_limit(200.0, 3600.0) == PHASE_LIMIT_FACTOR * 200.0
    assert phase_limit(2000.0, 3600.0) == 3600.0  # never later than the safety limit


def test_the_time_budget_ends_the_job_on_time_and_keeps_what_was_measured(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'budget.db'}"
    # Far more trials than fit, whatever the machine's speed: the space holds over a thousand
    # plans, and a trial costs the driver more than the 90 ms that 500 of them would have each.
    # The trials are short (four windows of 5 steps): a trial may start only while the budget
    # left after set-up exceeds its estimate, and at the start of a loaded suite the measured step
    # was 58 ms (a trial of 25-step windows was estimated at 19 s, set-up took over 26 s, and no
    # trial started, rightly). No confirmation: its reserve is estimated from the measured step,
    # which a loaded machine inflates past the whole budget. 45 s: trials compute for the whole
    # budget, so a longer one costs the suite its CPU time.
    space = _space(tmp_path, EXACT_ONLY, window_steps=5, max_windows=4)
    started = time.monotonic()
    assert run_cli("start", "--space", space, "--study", "budget", "--trials", "500", "--slots", "1",
                   "--storage", url, "--time-budget", "45s", "--no-confirm") == 0
    took = time.monotonic() - started
    out = capsys.readouterr().out
    # Set-up (Ray workers, the preflight) is part of the job; the budget holds within one trial's slack.
    assert took < 45 + 10, took
    study = optuna.load_study(study_name="budget", storage=url)
    done = measured(study)
    assert 1 <= len(done) < 500 and "time budget reached" in out
    with Store(url) as store:
        job = store.get_job("budget")
        assert all(store.outcome(job, t.number).status == "complete" for t in done)


def test_a_time_budget_is_checked(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error: one line, exit 2
        run_cli("start", "--space", str(SMOKE), "--time-budget", "0s")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--time-budget: '0s' must be between 1s and 7d" in err and err.count("\n") == 1


@pytest.mark.parametrize("text", ["10m", "90", "1.5h"])
def test_durations_parse(text):
    from erase_tune.cli_args import duration_arg

    assert duration_arg(text) == {"10m": 600, "90": 90, "1.5h": 5400}[text]
