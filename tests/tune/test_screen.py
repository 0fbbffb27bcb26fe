"""The structural screen: single changes first, in order (graph, place, cut), only those the
space can make; unions of the singles that gained only once every single has a result, pairs
before all of them; the parameters it enqueues make exactly its plans; and, in a real job, the
first trials after the seeds are the screen's singles, with their phase shown by status."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.runtime.probing import probe
from erase_tune.tune.search.codec import BoundSpace, DetachGuard
from erase_tune.tune.search.screen import (
    FAILED,
    MEASURED,
    RUNNING,
    SINGLE,
    UNION,
    PlanResult,
    Screen,
    ScreenStep,
    phase_of,
    results_of,
    screen_line,
)
from erase_tune.tune.search.space import SamplerSpec, SearchSpace, SpaceError
from erase_tune.tune.search.study import Attr


class Branches(nn.Module):
    """An embedding shared by two sibling branches, and a separate two-layer tower on the
    dense features; ``top`` makes the output from all three."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.left = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.tower = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
        self.top = nn.Linear(12, 1)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        return self.top(torch.cat([self.left(e), self.right(e), self.tower(dense)], dim=-1))


CANDIDATES = ["emb", "left", "right", "tower", "tower.1", "top"]
SPACE = """
workload: {name: mlp}
cuts:
  candidates:
    - {module: emb, modes: [keep, detach]}
    - left
    - right
    - tower
    - tower.1
    - {module: top, modes: [keep, place, graph]}
  modes: [keep, place, detach, graph]
  max_streams: 2
  dispatch: [threaded, blocking]
  graph: [false, true]
  whole_step_graph: [false, true]
  aux_weight: {low: 0.1, high: 0.5, log: true}
"""


@pytest.fixture(scope="module")
def bound() -> BoundSpace:
    """SPACE bound to Branches, its detach guard from the model's probe (as check_space makes it)."""
    model = Branches()
    found = probe(model, (torch.randint(0, 20, (8,)), torch.randn(8, 3)), CANDIDATES)
    return BoundSpace.unchecked(SearchSpace.loads(SPACE, source="t.yaml"), CANDIDATES, DetachGuard(found))


def measured(step: ScreenStep, gain: float, *, feasible: bool = True) -> PlanResult:
    return PlanResult(plan_key=step.key, state=MEASURED, qps_gain=gain, ne_gap=0.0, feasible=feasible)


def test_singles_in_order_graph_then_place_then_cut_each_as_the_space_makes_it(bound):
    screen = Screen(bound)
    names = [s.name for s in screen.singles]
    assert names == [
        "whole-step graph",
        # emb has no graph or place mode; everything else that may be graphed, then placed
        "graph left", "graph right", "graph tower", "graph tower.1", "graph top",
        "place left", "place right", "place tower", "place tower.1", "place top",
        # cut tower.1 alone would starve tower.0 (the guard refuses it); top may not be detached
        "cut emb", "cut left", "cut right", "cut tower",
    ]
    by = {s.name: s for s in screen.singles}
    assert all(s.phase == SINGLE for s in screen.singles)
    assert by["whole-step graph"].plan == ErasePlan(whole_step_graph=True)
    assert by["graph left"].plan == ErasePlan(graphs=(Graphed(module="left", stream=0),))
    assert by["place top"].plan == ErasePlan(placements=(Placement(module="top", stream=1),), num_streams=1)
    # λ 1 clamped into [0.1, 0.5]; a side stream; the space's first dispatch; a per-cut graph (it offers one)
    assert by["cut left"].plan == ErasePlan(cuts=(Cut(module="left", stream=1, aux_weight=0.5, graph=True),),
                                            num_streams=1, dispatch="threaded")


def test_the_enqueued_params_make_exactly_the_screens_plans(bound):
    screen = Screen(bound)
    gains = {"graph left": 0.05, "graph right": 0.04, "place tower": 0.03, "cut emb": 0.02, "place top": 0.01}
    results = [measured(s, gains.get(s.name, -0.01)) for s in screen.singles]
    steps = [*screen.singles, *screen.unions(results)]
    assert len({s.key for s in steps}) == len(steps)  # no plan twice
    study = optuna.create_study(directions=["maximize", "minimize"])
    for step in steps:
        assert bound.plan(optuna.trial.FixedTrial(step.params)) == step.plan
        assert bound.params(step.plan) == step.params
        study.enqueue_trial(step.params, user_attrs={Attr.PHASE: step.phase, Attr.SCREEN_NAME: step.name})
    for step in steps:  # ask() takes the oldest waiting trial, with the attributes it was enqueued with
        trial = study.ask()
        assert bound.plan(trial) == step.plan and trial.user_attrs[Attr.SCREEN_NAME] == step.name
        study.tell(trial, [0.0, 0.0])


def test_a_whole_step_graph_only_space_screens_what_differs_inside_it(bound):
    only = BoundSpace.unchecked(SearchSpace.loads(SPACE.replace("whole_step_graph: [false, true]",
                                                                "whole_step_graph: [true]")),
                                CANDIDATES, bound.can_detach)
    screen = Screen(only)
    # A graphed piece inside the step's graph is nothing more; placements and cuts remain, all inside it.
    assert [s.name for s in screen.singles] == ["place left", "place right", "place tower", "place tower.1",
                                                "place top", "cut emb", "cut left", "cut right", "cut tower"]
    assert all(s.plan.whole_step_graph for s in screen.singles)
    assert screen.singles[-1].plan.cuts[0].graph is False  # per-cut graphs mean nothing there


def test_invalid_singles_cost_no_trial():
    s = SearchSpace.loads(SPACE.replace("max_streams: 2", "max_streams: 0")
                          .replace("{module: top, modes: [keep, place, graph]}", "{module: top, modes: [keep, graph]}")
                          .replace("modes: [keep, place, detach, graph]", "modes: [keep, detach]"), source="t.yaml")
    guarded = BoundSpace.unchecked(s, CANDIDATES, lambda cuts, c: c != "left")
    screen = Screen(guarded)
    # No side streams: nothing placed, cuts on the main stream; left refused by the guard; only top graphed.
    assert [x.name for x in screen.singles] == ["whole-step graph", "graph top", "cut emb", "cut right", "cut tower",
                                                "cut tower.1"]
    assert screen.singles[2].plan.cuts == (Cut(module="emb", stream=0, aux_weight=0.5, graph=True),)
    assert all(x.params == guarded.params(x.plan) for x in screen.singles)
    for left_out in (ErasePlan(graphs=(Graphed(module="left"),)), ErasePlan(cuts=(Cut(module="left"),))):
        with pytest.raises(SpaceError):  # what the screen left out, the space refuses too
            guarded.params(left_out)


def test_unions_of_the_gainers_only_after_every_single_has_a_result(bound):
    screen = Screen(bound)
    gains = {"graph left": 0.05, "graph right": 0.04, "place tower": 0.03, "cut emb": 0.02, "cut left": 0.06,
             "cut right": 0.01, "graph tower.1": 0.02, "place top": 0.015, "whole-step graph": -0.02}
    infeasible = {"cut right"}
    results = [measured(s, gains.get(s.name, -0.01), feasible=s.name not in infeasible) for s in screen.singles]

    # One single without a result: it is next, and no union is known yet.
    assert screen.next(results[:-1]) == screen.singles[-1] and screen.unions(results[:-1]) is None
    # It runs: the unions wait for it, and the screen has nothing to enqueue meanwhile.
    running = [*results[:-1], PlanResult(plan_key=screen.singles[-1].key, state=RUNNING)]
    assert screen.next(running) is None and screen.waiting(running) == [screen.singles[-1].name]
    assert not screen.done(running) and "unions wait for the singles" in screen.stand(running)

    unions = screen.unions(results)
    # Per module its best element (left: the cut at +6%, not its graph at +5%); the infeasible cut of right and
    # the losers never. Pairs on disjoint modules, best sum of gains first (ties: earlier in the screen first),
    # named in screen order; tower and tower.1 overlap, so never together.
    assert [u.name for u in unions] == [
        "graph right + cut left",  # 0.10
        "place tower + cut left",  # 0.09
        "graph tower.1 + cut left", "cut emb + cut left",  # 0.08
        "place top + cut left",  # 0.075
        "graph right + place tower",  # 0.07
        "graph right + graph tower.1", "graph right + cut emb",  # 0.06
        "graph right + place top",  # 0.055
        "place tower + cut emb",  # 0.05
        "place tower + place top",  # 0.045
        "graph tower.1 + cut emb",  # 0.04
        "graph tower.1 + place top", "place top + cut emb",  # 0.035
        # Last, all of them: greedy by gain, graph tower.1 skipped (it overlaps place tower, picked before).
        "graph right + place tower + place top + cut emb + cut left",
    ]
    assert all(u.phase == UNION for u in unions)
    assert unions[0].plan == ErasePlan(cuts=(Cut(module="left", stream=1, aux_weight=0.5, graph=True),),
                                       graphs=(Graphed(module="right"),), num_streams=1, dispatch="threaded")
    # Side-stream elements each get their own side stream, cycling over the space's two.
    assert {p.stream for p in unions[-1].plan.placements} == {1, 2} == {c.stream for c in unions[-1].plan.cuts}

    # Every single has a result: the first union is next; measured or failed ones are skipped.
    assert screen.next(results) == unions[0]
    later = [*results, measured(unions[0], 0.1), PlanResult(plan_key=unions[1].key, state=FAILED),
             PlanResult(plan_key=unions[2].key, state=RUNNING)]
    assert screen.next(later) == unions[3] and screen.waiting(later) == []
    done = [*results, *(measured(u, 0.0) for u in unions)]
    assert screen.next(done) is None and screen.done(done) and screen.waiting(done) == []
    assert screen.stand(done).endswith(f"{len(unions)} of {len(unions)} unions measured (done)")


def test_with_a_seed_that_gained_the_screen_changes_that_seed(bound):
    both = ErasePlan(placements=(Placement(module="left", stream=1), Placement(module="right", stream=2)),
                     num_streams=2)
    # Another dispatch than the screen's own (the space's first, threaded): the screen cannot make it, no start.
    blocking = ErasePlan(cuts=(Cut(module="emb", stream=1, aux_weight=0.5, graph=True),), num_streams=1)
    seeded = dataclasses.replace(bound, seeds=[("both-placed", bound.params(both)),
                                               ("blocking-cut", bound.params(blocking))])
    screen = Screen(seeded)
    key = both.canonical().dumps()

    def seed(gain: float, state: str = MEASURED) -> list[PlanResult]:
        return [PlanResult(plan_key=key, state=state, qps_gain=gain, ne_gap=0.0, feasible=True),
                PlanResult(plan_key=blocking.canonical().dumps(), state=MEASURED, qps_gain=0.3, ne_gap=0.0,
                           feasible=True)]

    # While a seed runs the screen waits for it (the sampler may go on); a seed never asked does not count.
    running = seed(0.0, RUNNING)
    assert screen.next(running) is None and screen.waiting(running) == ["seed both-placed"]
    assert screen.unions(running) is None and not screen.done(running) and "waits for the seeds" in screen.stand(running)
    assert screen.next([]) == screen.singles[0]
    # A seed that did not gain: the singles of the unchanged plan.
    assert screen.next(seed(-0.01)) == screen.singles[0]

    # A seed that gained: single changes to it; what it already holds is no change.
    first = screen.next(seed(0.10))
    singles = []
    results = seed(0.10)
    while (step := screen.next(results)) is not None and step.phase == SINGLE:
        singles.append(step)
        results.append(measured(step, {"cut left": 0.12, "graph tower": 0.11, "place tower": 0.105}.get(
            step.name.removesuffix(" (in both-placed)"), 0.05)))
    assert first == singles[0] and all(s.name.endswith(" (in both-placed)") for s in singles)
    names = [s.name.removesuffix(" (in both-placed)") for s in singles]
    assert names == ["whole-step graph", "graph left", "graph right", "graph tower", "graph tower.1", "graph top",
                     "place tower", "place tower.1", "place top", "cut emb", "cut left", "cut right", "cut tower"]
    by = dict(zip(names, singles))
    # An element on a module the seed places replaces the placement; the rest of the seed stays.
    assert by["cut left"].plan == ErasePlan(cuts=(Cut(module="left", stream=1, aux_weight=0.5, graph=True),),
                                            placements=(Placement(module="right", stream=2),), num_streams=2,
                                            dispatch="threaded").canonical()
    assert by["place top"].plan.placements == (Placement(module="left", stream=1), Placement(module="right", stream=2),
                                               Placement(module="top", stream=1))
    # Unions of the changes that beat the seed's +10% (per module the best: tower graphed), into the seed.
    assert [u.name for u in screen.unions(results)] == ["graph tower + cut left (in both-placed)"]
    assert step == screen.unions(results)[0]
    assert step.plan.graphs == (Graphed(module="tower"),) and step.plan.placements == (
        Placement(module="right", stream=2),) and [c.module for c in step.plan.cuts] == ["left"]
    assert screen.stand(results).startswith("screen (changes to seed both-placed, +10.00%): 13 of 13 singles measured")


def test_a_union_the_space_refuses_costs_no_trial(bound):
    screen = Screen(bound)
    gains = {"cut left": 0.03, "cut right": 0.02, "cut emb": 0.01}
    results = [measured(s, gains.get(s.name, -0.01)) for s in screen.singles]
    # Cutting both sibling branches would leave the shared embedding without a gradient: the guard refuses
    # that pair, and the union of all skips cut right for it (left holds more), leaving only a pair again.
    assert [u.name for u in screen.unions(results)] == ["cut emb + cut left", "cut emb + cut right"]


def test_a_plan_already_measured_is_not_screened_again_and_no_gainer_means_no_union(bound):
    screen = Screen(bound)
    seed = screen.singles[3]  # say a seed of the space measured the same plan, as another trial
    results = [PlanResult(plan_key=seed.key, state=MEASURED, qps_gain=-0.1, ne_gap=0.0, feasible=True)]
    assert screen.next(results) == screen.singles[0]
    rest = [measured(s, -0.01) for s in screen.singles if s is not seed]
    assert screen.next(results + rest) is None and screen.unions(results + rest) == []
    # A trial enqueued for a step counts as its try, whatever plan it made: never enqueued twice.
    odd = PlanResult(plan_key="something else", state=FAILED, screen_name=screen.singles[0].name)
    assert screen.next([odd]) == screen.singles[1]


def test_results_phases_and_the_screen_line_are_read_from_trials(bound):
    screen = Screen(bound)
    step = screen.singles[1]
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial(step.params, user_attrs={Attr.PHASE: step.phase, Attr.SCREEN_NAME: step.name})
    t = study.ask()
    t.set_user_attr(Attr.PLAN_KEY, step.key)
    assert results_of(study.get_trials(deepcopy=False)) == [PlanResult(plan_key=step.key, state=RUNNING,
                                                                       screen_name=step.name)]
    t.set_user_attr(Attr.FEASIBLE, True)
    study.tell(t, [0.03, 0.0])
    repeat = study.ask()  # a repeat of it is answered from it: not a result of its own
    repeat.set_user_attr(Attr.PLAN_KEY, step.key)
    repeat.set_user_attr(Attr.DUPLICATE_OF, t.number)
    study.tell(repeat, [0.03, 0.0])
    assert results_of(study.get_trials(deepcopy=False)) == [
        PlanResult(plan_key=step.key, state=MEASURED, qps_gain=0.03, ne_gap=0.0, feasible=True, screen_name=step.name)]
    assert phase_of({Attr.PHASE: "screen-union"}) == "screen-union" and phase_of({Attr.SEED_NAME: "x"}) == "seed"
    assert phase_of({}) == "search"
    assert screen_line([("seed", MEASURED), ("search", MEASURED)]) is None
    assert screen_line([("screen-single", MEASURED)] * 6 + [("screen-single", RUNNING), ("screen-union", MEASURED),
                                                             ("screen-union", FAILED)]) == \
        "screen: 6 singles measured, 1 running; 1 unions measured, 1 failed"


def test_the_space_file_switch():
    assert SearchSpace.loads(SPACE).sampler.screen is True
    off = SearchSpace.loads(SPACE + "sampler: {name: front, seed: 0, screen: false}\n")
    assert off.sampler == SamplerSpec(name="front", seed=0, screen=False)
    with pytest.raises(SpaceError, match=r"^t.yaml: sampler.screen: 'yes' must be true or false$"):
        SearchSpace.loads(SPACE + "sampler: {name: front, screen: 'yes'}\n", source="t.yaml")
    with pytest.raises(SpaceError, match=r"sampler.'scren': unknown field \(fields are: name, screen, seed\)"):
        SearchSpace.loads(SPACE + "sampler: {name: front, scren: false}\n", source="t.yaml")


def test_a_job_measures_the_screens_singles_first(ray_cluster, tmp_path, capsys):
    from tests.tune.conftest import run_cli
    from tests.tune.faulty import write_space

    url = f"sqlite:///{tmp_path / 'screen.db'}"
    space = write_space(tmp_path / "screen.yaml", trials=5, cuts={"modes": ["keep", "place", "detach"]},
                        seeds=[{"name": "no-cuts", "plan": {"cuts": []}}])
    assert run_cli("start", "--space", space, "--study", "screen", "--storage", url, "--slots", 1,
                   "--no-confirm") == 0
    trials = optuna.load_study(study_name="screen", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5
    assert [t.user_attrs[Attr.PHASE] for t in trials] == ["seed"] + [SINGLE] * 4
    assert [t.user_attrs.get(Attr.SCREEN_NAME) for t in trials] == [
        None, "place subarchs.0", "place subarchs.1", "place subarchs.2", "cut subarchs.0"]
    assert trials[4].user_attrs[Attr.PLAN]["cuts"][0]["module"] == "subarchs.0"
    # Its 8 training batches are read again and again: said once, with the first trial trained for NE (the cut).
    err = capsys.readouterr().err
    assert err.count("read its batches") == 1 and "trial 4: training read its batches" in err, err
    assert "raise the workload's train_batches for one pass" in err
    assert run_cli("status", "--study", "screen", "--storage", url) == 0
    out = capsys.readouterr().out
    assert "phases: 1 seed, 4 screen-single" in out and "screen: 4 singles measured; 0 unions measured" in out
