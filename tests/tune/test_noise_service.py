"""The noise floor in the service: measured once per study, when its first plan with cuts is about
to run (real Ray, SQLite and PostgreSQL), stored with the study, used by feasibility, reused on resume, shown by
status; quality confirmation of front plans recorded and carried into the exported file."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from erase_tune.runtime import ErasePlan
from erase_tune.store import Store
from erase_tune.store.storage import open_storage
from erase_tune.tune.execute.executor import RayExecutor
from erase_tune.tune.run.confirm import confirm_quality_front
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import FrontPoint, pareto_front
from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space


class _Untouchable:
    """An executor that fails the test when anything of it is used."""

    def __getattr__(self, name):
        raise AssertionError(f"the executor was used ({name}) for plans that need no training")


def test_noise_floor_feasibility_resume_status_and_quality(storage_url, ray_cluster, tmp_path, capsys):
    space_path = write_space(
        tmp_path / "noise.yaml", trials=3, max_ne_gap=0.001,
        budget={"noise_repeats": 2, "quality_scale": 2, "quality_seeds": 2},
        seeds=[{"name": "placed", "plan": {"num_streams": 1, "placements": [{"module": "subarchs.0", "stream": 1}]}},
               {"name": "cut", "plan": {"num_streams": 1, "cuts": [{"module": "subarchs.1", "stream": 1}]}}],
        cuts={"modes": ["keep", "place", "detach"]})
    assert run_cli("start", "--space", space_path, "--study", "nf", "--storage", storage_url, "--repeats", 2,
                   "--slots", 1) == 0
    capsys.readouterr()

    study = optuna.load_study(study_name="nf", storage=storage_url)
    floor = study.user_attrs["noise_floor"]
    band = study.user_attrs["ne_noise_band"]
    assert floor["kinds"] == ["order", "order"] and band == max(abs(g) for g in floor["gaps"]) and band > 0
    with Store(storage_url) as store:
        stored = store.noise_floor(store.get_job("nf"))
    assert stored.band == band and list(stored.gaps) == floor["gaps"]

    trials = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if "duplicate_of" not in t.user_attrs]
    placed = next(t for t in trials if t.user_attrs.get("seed_name") == "placed")
    # Exact by construction: objective 0, its measured gap kept, never infeasible, on the front.
    assert placed.user_attrs["exact"] is True and placed.values[1] == 0.0 and "ne_gap" in placed.user_attrs
    assert placed.system_attrs["constraints"] == [-0.001] and placed.user_attrs["feasible"] is True
    assert placed.number in {p.number for p in pareto_front(study, 0.001)} or any(
        p.qps_gain >= placed.values[0] for p in pareto_front(study, 0.001))
    for t in trials:
        if not ErasePlan.from_dict(t.user_attrs["plan"]).cuts:
            continue
        assert t.user_attrs["exact"] is False
        assert t.system_attrs["constraints"] == [t.values[1] - (0.001 + band)]  # the budget beyond the noise
        assert t.user_attrs["feasible"] == (t.values[1] <= 0.001 + band)

    # Resumed with more trials: the floor is reused, not measured again.
    assert run_cli("start", "--space", space_path, "--study", "nf", "--storage", storage_url, "--trials", 4,
                   "--slots", 1, "--no-confirm") == 0
    capsys.readouterr()
    with Store(storage_url) as store:
        again = store.noise_floor(store.get_job("nf"))
    assert again.created_at == stored.created_at
    assert optuna.load_study(study_name="nf", storage=storage_url).user_attrs["noise_floor"] == floor

    assert run_cli("status", "--study", "nf", "--storage", storage_url) == 0
    out = capsys.readouterr().out
    assert f"noise floor of the NE gap: ±{band:.2%}" in out

    # Quality confirmation of the front (on a trial slot), then an export that records it.
    db = open_storage(storage_url)
    space = SearchSpace.load(space_path)
    executor = RayExecutor(None, workload=space.workload.name, slots=1, device="cpu")
    try:
        study = db.study("nf")
        front = pareto_front(study, 0.001)
        done = confirm_quality_front(db, study, space, executor, front)
    finally:
        executor.close()
        db.close()
    assert set(done) == {p.number for p in front[:5]}
    # Which plans make the front is measured (on a loaded machine it may hold exact plans only):
    # with a cut among them every plan's gap is over 2 seeds; with none nothing was trained.
    seeds = 2 if any(not q.exact for q in done.values()) else 0
    for number, q in done.items():
        assert q.steps == 2 * space.budget.per_trial.training_steps and q.seeds == seeds and q.band == band
        if q.exact:
            assert (q.ne_gap, q.ne_gap_lo, q.ne_gap_hi) == (0.0, -band, band)
        else:
            assert len(q.per_seed) == 2 and q.ne_gap_lo <= q.ne_gap <= q.ne_gap_hi
    # A front of exact plans only: nothing to train, so no worker is asked (an executor that is
    # touched fails the test) and each gets gap 0 within the floor.
    exact_front = [FrontPoint(number=t.number, qps_gain=t.values[0], ne_gap=t.values[1], gain_vs_eager=None,
                              gain_vs_graph=None, gain_detach_only=None, plan=t.user_attrs["plan"],
                              user_attrs=t.user_attrs) for t in trials if t.user_attrs.get("exact")]
    assert exact_front  # (the front itself may hold none: a faster cut's gap within the floor counts as equal)
    db = open_storage(storage_url)
    try:
        only_exact = confirm_quality_front(db, db.study("nf"), space, _Untouchable(), exact_front)
    finally:
        db.close()
    assert set(only_exact) == {p.number for p in exact_front[:3]}
    assert all(q.exact and (q.ne_gap, q.ne_gap_lo, q.ne_gap_hi, q.seeds) == (0.0, -band, band, 0)
               for q in only_exact.values())
    best = tmp_path / "best.yaml"
    assert run_cli("export", "--study", "nf", "--storage", storage_url, "--repeats", 2, "-o", best, "--force") == 0
    prov = ErasePlan.load(best).provenance
    assert prov["ne_noise_band"] == band and "search_ne_gap" in prov
    if prov["trial"] in done:
        q = done[prov["trial"]]
        assert (prov["confirmed_ne_gap"], prov["confirmed_ne_gap_lo"], prov["confirmed_ne_gap_hi"]) == (
            q.ne_gap, q.ne_gap_lo, q.ne_gap_hi)
