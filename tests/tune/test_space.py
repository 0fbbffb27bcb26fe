"""Search spaces: validation names file and field; sampled plans are valid, canonical, conditional."""

from __future__ import annotations

import optuna
import pytest

from erase_tune.runtime import Cut, ErasePlan
from erase_tune.tune.space import SearchSpace, SpaceError, plan_params

CANDIDATES = ["subarchs.0", "subarchs.1", "subarchs.2", "subarchs.3"]

SPACE = """
workload: {name: ctr, args: {batch: 64}}
cuts:
  candidates: [subarchs.0, subarchs.1, subarchs.2, subarchs.3]
  max_streams: 3
  dispatch: [blocking, threaded, deferred]
  graph: [false, true]
  whole_step_graph: [false, true]
  aux_weight: {low: 0.1, high: 2.0, log: true}
max_ne_gap: 0.05
sampler: {name: random, seed: 3}
budget: {warmup_steps: 5, windows: 2, window_steps: 3, quality_steps: 10, timeout_s: 60}
trials: 8
seeds:
  - name: no-cuts
    plan: {cuts: []}
  - name: all
    plan:
      num_streams: 3
      dispatch: threaded
      cuts: [{module: subarchs.0, stream: 1, graph: true}, {module: subarchs.1, stream: 3}]
"""


def space(text: str = SPACE) -> SearchSpace:
    return SearchSpace.loads(text, source="test.yaml")


def test_loads():
    s = space()
    assert s.workload == "ctr" and s.workload_args == {"batch": 64}
    assert s.max_streams == 3 and s.dispatch == ("blocking", "threaded", "deferred")
    assert s.aux_weight == (0.1, 2.0, True) and s.max_ne_gap == 0.05
    assert [name for name, _ in s.seeds] == ["no-cuts", "all"]
    # seed plans are canonical: stream 3 -> 2
    assert [c.stream for c in s.seeds[1][1].cuts] == [1, 2]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("max_streams: 3", "max_streams: -1"), "cuts.max_streams: -1 must be an integer >= 0"),
        (("dispatch: [blocking, threaded, deferred]", "dispatch: [blocking, async]"), "cuts.dispatch: 'async' is not one of"),
        (("name: random", "name: annealing"), "sampler.name: 'annealing' is not one of tpe, nsga2, gp, random"),
        (("max_ne_gap: 0.05", "max_ne_gap: lots"), "max_ne_gap: 'lots' must be a finite number"),
        (("trials: 8", "trials: 8\nbogus: 1"), "bogus: unknown field"),
        (("low: 0.1", "low: 5.0"), "cuts.aux_weight: need 0 < low <= high"),
        (("warmup_steps: 5", "warmup_steps: 1"), "budget.warmup_steps: 1 is too short"),
        (("stream: 3}", "stream: 7}"), "seeds[1].plan.cuts[1].stream: 7 is out of range"),
        (("graph: [false, true]", "graph: maybe"), "cuts.graph: must be true, false, or a list of them"),
        (("workload: {name: ctr, args: {batch: 64}}", "workload: {args: {}}"), "workload.name: required"),
        (("trials: 8", "trials: 8\ngain_over: fastest"), "gain_over: 'fastest' is not one of eager, graph"),
        (("trials: 8", "trials: 8\ngain_over: graph\ndevice: cpu"), "gain_over: graph needs CUDA"),
    ],
)
def test_bad_spaces_name_file_and_field(edit, needle):
    old, new = edit
    assert old in SPACE
    with pytest.raises(SpaceError) as e:
        space(SPACE.replace(old, new, 1))
    msg = str(e.value)
    assert msg.startswith("test.yaml: ") and needle in msg and "\n" not in msg, msg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(SpaceError, match="search space file not found"):
        SearchSpace.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cuts: [unclosed")
    with pytest.raises(SpaceError, match=r"bad.yaml: not valid YAML at line 1"):
        SearchSpace.load(bad)


def test_sampled_plans_are_valid_canonical_and_conditional():
    s = space()
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    seen_whole = seen_eager = False
    for _ in range(60):
        trial = study.ask()
        plan = s.plan_from_trial(trial, CANDIDATES)
        assert plan == plan.canonical()
        assert {c.module for c in plan.cuts} <= set(CANDIDATES)
        names = set(trial.params)
        if plan.whole_step_graph:
            seen_whole = True
            # launch order is fixed at capture: no dispatch or per-cut graph flag is asked
            assert "dispatch" not in names and not any(n.endswith(".graph") for n in names)
        elif plan.cuts:
            seen_eager = True
            assert "dispatch" in names
        for c in CANDIDATES:
            detached = trial.params[f"{c}.detach"]
            # stream, weight and graph flag are only asked for detached cuts
            assert (f"{c}.stream" in names) == detached and (f"{c}.aux_weight" in names) == detached
        study.tell(trial, [0.0, 0.0])
    assert seen_whole and seen_eager


def test_overlapping_candidates_are_never_both_detached():
    s = space(SPACE.replace("candidates: [subarchs.0, subarchs.1, subarchs.2, subarchs.3]",
                            "candidates: [blocks.0, blocks.0:2, blocks.1]"))
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(40):
        trial = study.ask()
        plan = s.plan_from_trial(trial, ["blocks.0", "blocks.0:2", "blocks.1"])  # would raise on overlap
        assert len(plan.cuts) <= 2
        study.tell(trial, [0.0, 0.0])


@pytest.mark.parametrize("seed_index", [0, 1])
def test_enqueued_seed_params_reproduce_the_seed_plan(seed_index):
    s = space()
    name, plan = s.seeds[seed_index]
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial(plan_params(s, plan, CANDIDATES))
    trial = study.ask()
    assert s.plan_from_trial(trial, CANDIDATES) == plan


def test_plan_params_rejects_plans_outside_the_space():
    s = space()
    with pytest.raises(SpaceError, match="not among the space's candidates"):
        plan_params(s, ErasePlan(cuts=(Cut(module="over"),)), CANDIDATES)
    with pytest.raises(SpaceError, match="aux_weight: 9.0 is outside"):
        plan_params(s, ErasePlan(cuts=(Cut(module="subarchs.0", aux_weight=9.0),)), CANDIDATES)


def test_objective_follows_gain_over():
    from erase_tune.errors import EraseTuneError
    from erase_tune.tune.study import objective_values

    metrics = {"gain_p90": 0.5, "gain_vs_reference": 0.05, "ne_gap": 0.01}
    assert objective_values(metrics, "eager") == [0.5, 0.01]
    assert objective_values(metrics, "graph") == [0.05, 0.01]
    with pytest.raises(EraseTuneError, match="needs CUDA"):
        objective_values({**metrics, "gain_vs_reference": None}, "graph")
