"""Per-candidate modes and the graph mode: parsed with one-line errors, sampled conditionally,
inverted exactly by BoundSpace.params, and checked against the model (a candidate that can never be
detached may still be placed or graphed)."""

from __future__ import annotations

import numpy as np
import optuna
import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import Cut, ErasePlan, Graphed, Placement
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.space import SearchSpace, SpaceError

DLRM = "workload: {name: dlrm, args: {batch: 32, rows: 50, emb_dim: 4, num_tables: 4, bot_mlp: '16-4', " \
       "top_mlp: '16-8-1', train_batches: 4, eval_batches: 2}}\n"
CANDIDATES = ["bot_l", "top_l", "top_l.0:4"]
SPACE = DLRM + """
cuts:
  candidates:
    - bot_l
    - {module: top_l, modes: [keep, place, graph]}
    - {module: "top_l.0:4", modes: [keep, graph]}
  modes: [keep, place, detach, graph]
  max_streams: 2
  dispatch: [blocking, threaded]
  graph: [false, true]
  whole_step_graph: [false, true]
  aux_weight: {low: 0.1, high: 2.0, log: true}
seeds:
  - name: top_l-graphed
    plan: {graphs: [{module: top_l, stream: 0}]}
  - name: both
    plan:
      num_streams: 2
      cuts: [{module: bot_l, stream: 2}]
      graphs: [{module: top_l, stream: 1}]
"""


def space(text: str = SPACE) -> SearchSpace:
    return SearchSpace.loads(text, source="t.yaml")


def test_a_candidate_may_give_its_own_modes() -> None:
    s = space()
    assert s.cuts.modules == ("bot_l", "top_l", "top_l.0:4") and s.cuts.modes == ("keep", "place", "detach", "graph")
    assert [c.modes for c in s.cuts.candidates] == [None, ("keep", "place", "graph"), ("keep", "graph")]
    assert s.modes_of("bot_l") == s.cuts.modes and s.modes_of("top_l.0:4") == ("keep", "graph")
    assert s.may_detach
    # An entry with no modes takes the space's; the seeds' graphed pieces are read and canonical.
    plain = space(SPACE.replace("{module: top_l, modes: [keep, place, graph]}", "{module: top_l}"))
    assert plain.cuts.own_modes("top_l") is None and plain.modes_of("top_l") == plain.cuts.modes
    assert s.seeds[0].plan == ErasePlan(graphs=(Graphed(module="top_l"),))
    assert s.seeds[1].plan.graphs == (Graphed(module="top_l", stream=2),) and s.seeds[1].plan.cuts[0].stream == 1
    only_graph = space(SPACE.replace("modes: [keep, place, detach, graph]", "modes: [keep, graph]"))
    assert not only_graph.may_detach


@pytest.mark.parametrize(("old", "new", "needle"), [
    ("{module: top_l, modes: [keep, place, graph]}", "{module: top_l, modes: [keep, teleport]}",
     "cuts.candidates[1].modes: 'teleport' is not one of keep, place, detach, graph"),
    ("{module: top_l, modes: [keep, place, graph]}", "{module: top_l, modes: []}",
     "cuts.candidates[1].modes: must be a non-empty list from keep, place, detach, graph"),
    ("{module: top_l, modes: [keep, place, graph]}", "{modes: [keep]}",
     "cuts.candidates[1].module: None must be a module name (or a run like blocks.0:2)"),
    ("{module: top_l, modes: [keep, place, graph]}", "{module: top_l, mode: [keep]}",
     "cuts.candidates[1].'mode': unknown field (fields are: modes, module)"),
    ("{module: top_l, modes: [keep, place, graph]}", "5", "cuts.candidates[1]: 5 must be a module name"),
    ("{module: top_l, modes: [keep, place, graph]}", "[top_l]", "cuts.candidates[1]: ['top_l'] must be a module name"),
    ("{module: top_l, modes: [keep, place, graph]}", "{module: 'top l'}",
     "cuts.candidates: module: 'top l' is neither a dotted module name nor a run"),
    ("{module: top_l, modes: [keep, place, graph]}", "{module: bot_l, modes: [keep]}",
     "cuts.candidates: lists 'bot_l' twice"),
    ("max_streams: 2", "max_streams: 0", "cuts.modes: place needs side streams (cuts.max_streams >= 1)"),
    ("modes: [keep, place, detach, graph]", "modes: [keep, detach, graph]\n  max_streams: 0",
     "cuts.candidates[1].modes: place needs side streams (cuts.max_streams >= 1)"),
    ("modes: [keep, place, detach, graph]", "modes: [keep, detach, graphs]",
     "cuts.modes: 'graphs' is not one of keep, place, detach, graph"),
    ("graphs: [{module: top_l, stream: 0}]", "graphs: [{module: top_l, stream: -1}]",
     "seeds[0].plan.graphs[0].stream: -1 must be an integer in 0..64"),
])  # fmt: skip
def test_bad_candidate_entries_are_one_line(old: str, new: str, needle: str) -> None:
    assert old in SPACE
    text = SPACE.replace(old, new, 1)
    if "max_streams: 0" in new:  # max_streams appears once more below the modes
        text = text.replace("  max_streams: 2\n", "", 1)
    with pytest.raises(SpaceError) as e:
        space(text)
    message = str(e.value)
    assert message.startswith("t.yaml: ") and needle in message and "\n" not in message, message


def _variants() -> list[SearchSpace]:
    return [space(), space(SPACE.replace("max_streams: 2", "max_streams: 2\n  streams: round_robin")),
            space(SPACE.replace("max_streams: 2", "max_streams: 0").replace("[keep, place, graph]", "[keep, graph]")
                  .replace("modes: [keep, place, detach, graph]", "modes: [keep, detach, graph]"))]


@pytest.mark.parametrize("index", range(3), ids=["searched", "round_robin", "no-side-streams"])
def test_plans_and_params_are_inverses_over_random_params(index: int) -> None:
    variant = _variants()[index]
    s = variant.cuts
    bound = BoundSpace.unchecked(variant, CANDIDATES)
    key = bound.key
    rng = np.random.RandomState(index)
    seen: set[str] = set()
    for _ in range(300):
        plan_yaml, params = key({}, rng)  # every parameter the plan needs, drawn at random
        plan = ErasePlan.loads(plan_yaml)
        assert plan == plan.canonical()
        again = bound.params(plan)
        assert bound.plan(optuna.trial.FixedTrial(again)) == plan, (params, again)
        modes = {c: params.get(f"{c}.mode", variant.modes_of(c)[0]) for c in CANDIDATES}
        assert "top_l" not in {c.module for c in plan.cuts}  # its own modes exclude detach
        assert "top_l.0:4" not in {p.module for p in plan.placements} or plan.whole_step_graph
        for c in CANDIDATES:  # a graphed piece's stream is asked for graphed candidates only
            assert (f"{c}.graph_stream" in params) == (modes[c] == "graph" and s.max_streams > 0
                                                       and s.streams == "searched"), (c, params)
        for g in plan.graphs:
            assert not plan.whole_step_graph and 0 <= g.stream <= s.max_streams
            seen.add(f"graph@{'side' if g.stream else 'main'}")
        seen.update(f"{t}" for t in ("cut", "placement") if getattr(plan, f"{t}s"))
        if plan.whole_step_graph:
            seen.add("whole")
    want = {"graph@main", "cut", "whole"} | ({"graph@side", "placement"} if s.max_streams else set())
    if s.streams == "round_robin":
        want.discard("graph@main")  # round robin: a graphed piece takes its fixed side stream, as a placement
    assert want <= seen, seen


def test_plan_params_refuses_graphs_outside_the_space() -> None:
    bound = BoundSpace.unchecked(space(), CANDIDATES)
    with pytest.raises(SpaceError, match=r"top_l.0:4.graph_stream: 3 is outside the space's streams 0..2"):
        bound.params(ErasePlan(graphs=(Graphed(module="top_l.0:4", stream=3),), num_streams=3))
    no_graph = space(SPACE.replace("modes: [keep, place, detach, graph]", "modes: [keep, place, detach]"))
    with pytest.raises(SpaceError, match=r"bot_l.mode: 'graph' is not one of the space's choices"):
        BoundSpace.unchecked(no_graph, CANDIDATES).params(ErasePlan(graphs=(Graphed(module="bot_l"),)))
    with pytest.raises(SpaceError, match=r"'emb_l.0' is not among the space's candidates"):
        bound.params(ErasePlan(graphs=(Graphed(module="emb_l.0"),)))
    with pytest.raises(SpaceError, match=r"top_l.0:4.mode: 'place' is not one of the space's choices"):
        bound.params(ErasePlan(placements=(Placement(module="top_l.0:4", stream=1),), num_streams=1))


def test_the_checked_space_never_detaches_what_cannot_be() -> None:
    s = space()
    checked = check_space(s)
    assert checked.candidates == CANDIDATES and [n for n, _ in checked.seeds] == ["top_l-graphed", "both"]
    assert checked.seeds[0][1]["top_l.mode"] == "graph" and checked.seeds[0][1]["top_l.graph_stream"] == 0
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        plan = checked.plan(trial)
        assert {c.module for c in plan.cuts} <= {"bot_l"}
        study.tell(trial, [0.0, 0.0])


def test_the_workloads_own_candidates_are_offered_what_works() -> None:
    """No candidates listed: dlrm's own include top_l, which produces the output. It is placed or
    graphed, never detached, and the space is not refused for it."""
    s = space(DLRM + "cuts: {max_streams: 1, modes: [keep, place, detach, graph]}\n")
    checked = check_space(s)
    assert checked.candidates == ["bot_l", "bot_l.0:2", "top_l", "top_l.0:4"]
    assert not checked.can_detach([], "top_l") and not checked.can_detach([Cut(module="bot_l")], "top_l.0:4")
    assert checked.can_detach([], "bot_l") and checked.can_detach([], "bot_l.0:2")
    modes_seen: set[str] = set()
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(60):
        trial = study.ask()
        plan = checked.plan(trial)
        assert {c.module for c in plan.cuts} <= {"bot_l", "bot_l.0:2"}
        modes_seen.update(v for k, v in trial.params.items() if k.startswith("top_l.mode"))
        study.tell(trial, [0.0, 0.0])
    assert modes_seen == {"keep", "place", "graph"}


@pytest.mark.parametrize(("candidates", "needle"), [
    ("[bot_l, top_l]", r"cuts.candidates: cut 'top_l' produces the model's output: .*place it instead\)$"),
    ("[bot_l, {module: top_l, modes: [keep, detach]}]",
     r"cuts.candidates: cut 'top_l' produces the model's output: .*; leave detach out of its modes$"),
    ("[bot_l, 'top_l.0:4']", r"cuts.candidates: plan leaves \d+ parameters untrained: emb_l.0.weight, .*, even with "
                             r"every candidate before it detached too$"),
    ("[bot_l, {module: 'top_l.0:4', modes: [keep, place, detach]}]",
     r"cuts.candidates: plan leaves \d+ parameters untrained: emb_l.0.weight, .*, even with every candidate before "
     r"it detached too; leave detach out of its modes$"),
])  # fmt: skip
def test_a_listed_candidate_that_cannot_be_detached_is_refused_in_one_line(candidates: str, needle: str) -> None:
    s = space(DLRM + f"cuts: {{max_streams: 1, modes: [keep, place, detach, graph], candidates: {candidates}}}\n")
    with pytest.raises(EraseTuneError, match=r"^t.yaml: " + needle) as e:
        check_space(s)
    assert "\n" not in str(e.value)


def test_a_finite_space_enumerates_each_candidates_own_modes() -> None:
    from erase_tune.tune.search.replay import space_plans

    s = space(SPACE.split("seeds:")[0].replace("max_streams: 2", "max_streams: 2\n  streams: round_robin")
              .replace("dispatch: [blocking, threaded]", "dispatch: [blocking]")
              .replace("graph: [false, true]", "graph: [false]")
              .replace("whole_step_graph: [false, true]", "whole_step_graph: [false]")
              .replace("aux_weight: {low: 0.1, high: 2.0, log: true}", "aux_weight: 1.0"))  # fmt: skip
    plans = space_plans(check_space(s))
    # bot_l: keep, place, detach or graph; then top_l placed or graphed, or kept with top_l.0:4 kept or graphed.
    assert len(plans) == 4 * 4 == len({p.dumps() for p in plans})
    assert sum(not p.graphs for p in plans) == 3 * 2  # bot_l kept, placed or detached; top_l kept or placed
    assert not any(c.module != "bot_l" for p in plans for c in p.cuts)
