"""Search spaces: validation names file and field; sampled plans are valid, canonical, conditional."""

from __future__ import annotations

import optuna
import pytest

from erase_tune.runtime import Cut, ErasePlan, Placement
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import AuxWeight, SearchSpace, SpaceError

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
  - name: placed
    plan:
      num_streams: 3
      placements: [{module: subarchs.2, stream: 2}, {module: subarchs.3, stream: 3}]
"""


def space(text: str = SPACE) -> SearchSpace:
    return SearchSpace.loads(text, source="test.yaml")


def test_loads():
    s = space()
    assert s.workload.name == "ctr" and s.workload.args == {"batch": 64}
    assert s.cuts.max_streams == 3 and s.cuts.dispatch == ("blocking", "threaded", "deferred")
    assert s.cuts.aux_weight == AuxWeight(0.1, 2.0, True) and s.max_ne_gap == 0.05
    assert [seed.name for seed in s.seeds] == ["no-cuts", "all", "placed"]
    assert s.cuts.modes == ("keep", "place", "detach")
    # seed plans are canonical: stream 3 -> 2
    assert [c.stream for c in s.seeds[1].plan.cuts] == [1, 2]


def test_gpus_per_trial_defaults_to_one():
    assert space(SPACE).gpus_per_trial == 1
    assert space(SPACE.replace("trials: 8", "trials: 8\ngpus_per_trial: 4", 1)).gpus_per_trial == 4


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("max_streams: 3", "max_streams: -1"), "cuts.max_streams: -1 must be an integer in 0..64"),
        (("max_streams: 3", "max_streams: 1000000000000"), "cuts.max_streams: a huge integer must be an integer in"),
        (("max_streams: 3", "max_streams: 3\n  modes: [keep, teleport]"), "cuts.modes: 'teleport' is not one of"),
        (("max_streams: 3", "max_streams: 0\n  modes: [keep, place]"), "cuts.modes: place needs side streams"),
        (("seed: 3}", "seed: 1099511627776}"), "sampler.seed: a huge integer must be an integer in 0..4294967295"),
        (("trials: 8", "trials: 8\nobjectives: 5"), "objectives: must be ['qps_gain', 'ne_gap']"),
        (("trials: 8", "trials: 8\n1: x"), "key 1: keys must be strings"),
        (("dispatch: [blocking, threaded, deferred]", "dispatch: [blocking, async]"), "cuts.dispatch: 'async' is not one of"),
        (("name: random", "name: annealing"), "sampler.name: 'annealing' is not one of front, tpe, nsga2, gp, random"),
        (("max_ne_gap: 0.05", "max_ne_gap: lots"), "max_ne_gap: 'lots' must be a finite number"),
        (("trials: 8", "trials: 8\nbogus: 1"), "'bogus': unknown field"),
        (("low: 0.1", "low: 5.0"), "cuts.aux_weight: need 0 < low <= high"),
        (("warmup_steps: 5", "warmup_steps: 1"), "budget.warmup_steps: 1 is too short"),
        (("warmup_steps: 5", "confirm_max_windows: 1, warmup_steps: 5"),
         "budget.confirm_max_windows: 1 must be an integer in 2..1000"),
        (("warmup_steps: 5", "confirm_max_windows: 12.5, warmup_steps: 5"), "budget.confirm_max_windows: 12.5"),
        (("stream: 3}", "stream: 7}"), "seeds[1].plan.cuts[1].stream: 7 is out of range"),
        (("graph: [false, true]", "graph: maybe"), "cuts.graph: must be true, false, or a list of them"),
        (("workload: {name: ctr, args: {batch: 64}}", "workload: {args: {}}"), "workload.name: required"),
        (("trials: 8", "trials: 8\ngain_over: fastest"), "gain_over: 'fastest' is not one of eager, graph"),
        (("trials: 8", "trials: 8\ngain_over: graph\ndevice: cpu"), "gain_over: graph needs CUDA"),
        (("trials: 8", "trials: 8\ngpus_per_trial: 0"), "gpus_per_trial: 0 must be an integer in 1..64"),
        (("trials: 8", "trials: 8\ngpus_per_trial: 65"), "gpus_per_trial: 65 must be an integer in 1..64"),
        (("trials: 8", "trials: 8\ngpus_per_trial: '2'"), "gpus_per_trial: '2' must be an integer in 1..64"),
        (("trials: 8", "trials: 8\ngpus_per_trial: true"), "gpus_per_trial: True must be an integer in 1..64"),
    ],
)
def test_bad_spaces_name_file_and_field(edit, needle):
    old, new = edit
    assert old in SPACE
    with pytest.raises(SpaceError) as e:
        space(SPACE.replace(old, new, 1))
    msg = str(e.value)
    assert msg.startswith("test.yaml: ") and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text, needle", [
    ("workload: ctr\nseeds: 5", "seeds: must be a list of {name, plan}"),
    ("workload: ctr\nobjectives: 5", "objectives: must be"),
    ("workload: ctr\nbudget: {windows: 100000000000000000000000}", "budget.windows"),
    ("workload: ctr\n? [1, 2]\n: 3", "unhashable key"),
    ("workload: ctr\n3: x", "keys must be strings"),
    ("workload: 5", "workload: must be {name, args}, got int"),
    ("- a\n- b", "the file: must be a search space, got list"),
])
def test_malformed_shapes_are_one_line(text, needle):
    with pytest.raises(SpaceError) as e:
        space(text)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_front_is_re_measured_for_at_most_confirm_max_windows():
    assert space().budget.confirm_max_windows == 40  # the default: about what ±2% needs on a host-bound step
    assert space(SPACE.replace("warmup_steps: 5", "confirm_max_windows: 8, warmup_steps: 5", 1)).budget.confirm_max_windows == 8


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(SpaceError, match="search space file not found"):
        SearchSpace.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cuts: [unclosed")
    with pytest.raises(SpaceError, match=r"bad.yaml: not valid YAML at line 1"):
        SearchSpace.load(bad)


def test_sampled_plans_are_valid_canonical_and_conditional():
    bound = BoundSpace.unchecked(space(), CANDIDATES)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    seen_whole = seen_eager = seen_placed = False
    for _ in range(60):
        trial = study.ask()
        plan = bound.plan(trial)
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
            mode = trial.params[f"{c}.mode"]
            # a detached cut's stream, weight and graph flag only for detached cuts; a placement's stream
            assert (f"{c}.stream" in names) == (mode == "detach") == (f"{c}.aux_weight" in names)
            assert (f"{c}.place_stream" in names) == (mode == "place")
            assert (c in {p.module for p in plan.placements}) == (mode == "place")
        seen_placed = seen_placed or bool(plan.placements)
        study.tell(trial, [0.0, 0.0])
    assert seen_whole and seen_eager and seen_placed


def test_overlapping_candidates_are_never_both_detached():
    s = space(SPACE.replace("candidates: [subarchs.0, subarchs.1, subarchs.2, subarchs.3]",
                            "candidates: [blocks.0, blocks.0:2, blocks.1]"))
    bound = BoundSpace.unchecked(s, ["blocks.0", "blocks.0:2", "blocks.1"])
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(40):
        trial = study.ask()
        plan = bound.plan(trial)  # would raise on overlap
        assert len(plan.cuts) + len(plan.placements) <= 2
        study.tell(trial, [0.0, 0.0])


@pytest.mark.parametrize("seed_index", [0, 1, 2])
def test_enqueued_seed_params_reproduce_the_seed_plan(seed_index):
    s = space()
    bound = BoundSpace.unchecked(s, CANDIDATES)
    plan = s.seeds[seed_index].plan
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial(bound.params(plan))
    trial = study.ask()
    assert bound.plan(trial) == plan


def test_plan_params_rejects_plans_outside_the_space():
    bound = BoundSpace.unchecked(space(), CANDIDATES)
    with pytest.raises(SpaceError, match="not among the space's candidates"):
        bound.params(ErasePlan(cuts=(Cut(module="over"),)))
    with pytest.raises(SpaceError, match="aux_weight: 9.0 is outside"):
        bound.params(ErasePlan(cuts=(Cut(module="subarchs.0", aux_weight=9.0),)))
    no_place = space(SPACE.replace("max_streams: 3", "max_streams: 3\n  modes: [keep, detach]"))
    with pytest.raises(SpaceError, match="subarchs.0.mode: 'place' is not one of the space's choices"):
        BoundSpace.unchecked(no_place, CANDIDATES).params(
            ErasePlan(placements=(Placement(module="subarchs.0", stream=1),), num_streams=1))


def test_objective_follows_gain_over():
    from erase_tune.errors import EraseTuneError
    from erase_tune.tune.search.study import objective_values

    metrics = {"gain_vs_eager": 0.5, "gain_vs_graph": 0.05, "ne_gap": 0.01}
    assert objective_values(metrics, "eager") == [0.5, 0.01]
    assert objective_values(metrics, "graph") == [0.05, 0.01]
    with pytest.raises(EraseTuneError, match="needs CUDA"):
        objective_values({"gain_vs_eager": 0.5, "ne_gap": 0.01}, "graph")
