"""ErasePlan: validation names the field at fault; YAML round trip; derived plans."""

from __future__ import annotations

import pytest
from torch import nn

from erase_tune import Cut, ErasePlan, Placement, PlanError
from erase_tune.runtime import Graphed
from erase_tune.runtime import targets_overlap


def _plan(**kw) -> ErasePlan:
    base = dict(
        cuts=(Cut(module="towers.0", stream=1, aux_weight=0.5, graph=True), Cut(module="blocks.1:3", stream=2)),
        num_streams=2,
        dispatch="threaded",
    )
    base.update(kw)
    return ErasePlan(**base)


def test_round_trip_yaml(tmp_path):
    plan = _plan(provenance={"study": "s1", "gain": 0.12})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    back = ErasePlan.load(path)
    assert back == plan
    assert back.cuts[1].members == ("blocks.1", "blocks.2")
    assert back.provenance["gain"] == 0.12


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(cuts=(Cut(module="towers.0", stream=3),), num_streams=2), "cuts[0].stream"),
        (dict(cuts=(Cut(module="towers.0"), Cut(module="towers.0"))), "cuts[1].module"),
        (dict(cuts=(Cut(module="towers"), Cut(module="towers.1"))), "cuts[1].module"),
        (dict(cuts=(Cut(module="blocks.0:3"), Cut(module="blocks.2"))), "cuts[1].module"),
        (dict(dispatch="async"), "dispatch"),
        (dict(num_streams=-1), "num_streams"),
        (dict(version=2), "version"),
        (dict(cuts=(Cut(module="towers.0", graph=True),), dispatch="deferred"), "cuts[0].graph"),
    ],
)
def test_invalid_plans_name_the_field(kw, field):
    with pytest.raises(PlanError) as e:
        _plan(**kw)
    assert str(e.value).startswith(field), str(e.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(module="a.3:1"), "module"),
        (dict(module="towers.0", aux_weight=0), "aux_weight"),
        (dict(module="towers.0", aux_weight=float("nan")), "aux_weight"),
        (dict(module="towers.0", stream=True), "stream"),
        (dict(module="has space"), "module"),
    ],
)
def test_invalid_cuts(kw, field):
    with pytest.raises(PlanError) as e:
        Cut(**kw)
    assert str(e.value).startswith(field)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("cuts: [{module: towers.0, strem: 1}]", "cuts[0].strem: unknown field"),
        ("cuts: [{stream: 1}]", "cuts[0].module: missing"),
        ("dispatch: fast", "dispatch: 'fast' is not one of"),
        ("[1, 2", "not valid YAML"),
        ("- a\n- b", "a plan must be a mapping"),
        ("num_streams: 1\ncuts: [{module: x, stream: 2}]", "cuts[0].stream: 2 is out of range 0..1"),
        ("bogus: 1", "bogus: unknown field"),
        ("!!python/object/apply:os.system ['true']", "not valid YAML"),
    ],
)
def test_load_errors_name_file_and_field(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as e:
        ErasePlan.load(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and needle in msg and "\n" not in msg, msg


def test_missing_file():
    with pytest.raises(PlanError, match="plan file not found"):
        ErasePlan.load("/nonexistent/plan.yaml")


def test_check_model_names_missing_module():
    model = nn.Module()
    model.towers = nn.ModuleList([nn.Linear(2, 2)])
    model.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    ErasePlan(cuts=(Cut(module="towers.0"), Cut(module="blocks.0:2"))).check_model(model)
    with pytest.raises(PlanError, match=r"cuts\[0\].module: Module has no submodule 'towers.7'"):
        ErasePlan(cuts=(Cut(module="towers.7"),)).check_model(model)
    with pytest.raises(PlanError, match="ends past 'blocks', which has 2 blocks"):
        ErasePlan(cuts=(Cut(module="blocks.1:3"),)).check_model(model)
    with pytest.raises(PlanError, match="is not a ModuleList or Sequential"):
        ErasePlan(cuts=(Cut(module="towers.0.0:1"),)).check_model(model)


def test_canonical_merges_equivalent_plans():
    a = ErasePlan(cuts=(Cut(module="b", stream=3), Cut(module="a", stream=1)), num_streams=4)
    b = ErasePlan(cuts=(Cut(module="a", stream=2), Cut(module="b", stream=4)), num_streams=4)
    assert a.canonical() == b.canonical()
    assert a.canonical().num_streams == 2
    g = ErasePlan(cuts=(Cut(module="a", graph=True),), dispatch="threaded", whole_step_graph=True).canonical()
    assert g.dispatch == "blocking" and not g.cuts[0].graph


def test_detach_only_twin():
    twin = _plan().detach_only()
    assert twin.dispatch == "deferred" and twin.num_streams == 0
    assert [c.module for c in twin.cuts] == ["towers.0", "blocks.1:3"]
    assert all(c.stream == 0 and not c.graph for c in twin.cuts)
    assert _plan().without_cuts().cuts == ()


def test_plans_pickle():
    """Plans travel to trial workers (Ray pickles them)."""
    import pickle

    plan = _plan(provenance={"trial": 3})
    assert pickle.loads(pickle.dumps(plan)) == plan


# -- placements -------------------------------------------------------------------------------


def _placed(**kw) -> ErasePlan:
    base = dict(
        cuts=(Cut(module="towers.0", stream=3), Cut(module="blocks.0:2")),
        placements=(Placement(module="towers.2", stream=1), Placement(module="blocks.2:4", stream=3)),
        num_streams=4,
    )
    base.update(kw)
    return ErasePlan(**base)


def test_placements_round_trip_and_describe(tmp_path):
    plan = _placed()
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert "placements:\n- module: towers.2\n  stream: 1\n" in path.read_text()
    assert ErasePlan.load(path) == plan
    assert ErasePlan.loads("num_streams: 3\nplacements: [{module: subarchs.2, stream: 3}]").placements == (
        Placement(module="subarchs.2", stream=3),
    )
    assert plan.describe() == (
        "towers.0@s3, blocks.0:2@s0, towers.2@s1(placed), blocks.2:4@s3(placed); 4 side stream(s), blocking"
    )
    assert "placements" not in ErasePlan(cuts=(Cut(module="a"),)).dumps()  # old plans keep their text


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(placements=(Placement(module="towers.0", stream=1),)), r"^placements\[0\].module: 'towers.0' overlaps cuts\[0\]"),
        (dict(placements=(Placement(module="blocks", stream=1),)), r"^placements\[0\].module: 'blocks' overlaps cuts\[1\]"),
        (dict(placements=(Placement(module="towers.2.0", stream=1), Placement(module="towers.2", stream=2))),
         r"^placements\[1\].module: 'towers.2' overlaps placements\[0\].module 'towers.2.0'"),
        (dict(placements=(Placement(module="towers.2", stream=4),), num_streams=3),
         r"^placements\[0\].stream: 4 is out of range 1..3"),
    ],
)
def test_placement_checks(kw, message):
    with pytest.raises(PlanError, match=message):
        _placed(**kw)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("placements: [{module: a, stream: 0}]", "placements[0].stream: 0 is the main stream"),
        ("placements: [a]", "placements[0]: must be a mapping with 'module' and 'stream'"),
        ("placements: [{module: a}]", "placements[0].stream: missing"),
        ("placements: [{module: a, stream: 1, aux_weight: 2}]", "placements[0].aux_weight: unknown field"),
        ("placements: {module: a}", "placements: must be a list"),
    ],
)
def test_placement_file_errors(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as e:
        ErasePlan.load(path)
    assert needle in str(e.value), str(e.value)


def test_check_model_covers_placements():
    model = nn.Module()
    model.towers = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(PlanError, match=r"^placements\[0\].module: Module has no submodule 'towers.3'"):
        ErasePlan(placements=(Placement(module="towers.3", stream=1),), num_streams=1).check_model(model)


def test_canonical_renumbers_streams_over_cuts_and_placements():
    a = ErasePlan(cuts=(Cut(module="b", stream=5),), placements=(Placement(module="a", stream=2),
                                                                 Placement(module="c", stream=5)), num_streams=6)
    b = ErasePlan(cuts=(Cut(module="b", stream=1),), placements=(Placement(module="c", stream=1),
                                                                 Placement(module="a", stream=4)), num_streams=4)
    assert a.canonical() == b.canonical()
    c = a.canonical()
    assert c.num_streams == 2 and [p.stream for p in c.placements] == [1, 2] and c.cuts[0].stream == 2


def test_detach_only_and_without_cuts_drop_placements():
    twin = _placed().detach_only()
    assert twin.placements == () and twin.num_streams == 0 and twin.dispatch == "deferred"
    assert [c.stream for c in twin.cuts] == [0, 0]
    bare = _placed().without_cuts()
    assert bare.cuts == () and bare.placements == () and bare.num_streams == 0


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("towers.0", "towers.0", True),
        ("towers", "towers.0.1", True),
        ("towers.0", "towers.01", False),
        ("towers.0", "towers.10", False),
        ("blocks.2:5", "blocks.4", True),
        ("blocks.2:5", "blocks.5", False),
        ("blocks.2:5", "blocks.3.fc", True),
        ("blocks.2:5", "blocks", True),
        ("blocks.2:5", "blocks.4:9", True),
        ("blocks.2:5", "blocks.5:9", False),
        ("blocks.0:100000", "blocks.99999.inner.0:2", True),
        ("blocks.0:3", "blocks.3.inner.0:2", False),
        ("blocks.0:3", "other.0:3", False),
        ("a.blocks.0:3", "a.blocks", True),
    ],
)
def test_overlaps_is_decided_without_listing_members(a, b, expected):
    assert targets_overlap(a, b) is expected and targets_overlap(b, a) is expected


def test_provenance_is_plain_data():
    plan = ErasePlan(provenance={"workload": "ctr", "workload_args": {"batch": 2048}, "seeds": [0, 1], "gain": None})
    assert ErasePlan.loads(plan.dumps()) == plan
    for bad, where in [
        ({"a": {"b": {"c": 1}}}, "provenance.a.b"),
        ({"a": [[1]]}, r"provenance.a\[0\]"),
        ({"a": object()}, "provenance.a"),
        ({1: "x"}, "provenance.1: keys must be strings"),
        ({"a": 2**70}, "provenance.a: <an integer of 71 bits> is out of range"),
    ]:
        with pytest.raises(PlanError, match=f"^{where}"):
            ErasePlan(provenance=bad)


# -- graphed pieces: captured as CUDA graphs inside an eager step, not detached --------------------


def test_graphed_round_trip_describe_and_exactness(tmp_path):
    plan = ErasePlan(cuts=(Cut(module="a", stream=1),), graphs=(Graphed(module="top"), Graphed(module="b", stream=2)),
                     num_streams=2)
    path = tmp_path / "p.yaml"
    plan.save(path)
    again = ErasePlan.load(path)
    assert again == plan
    assert "top@s0(graphed)" in plan.describe() and "b@s2(graphed)" in plan.describe()
    assert ErasePlan.loads("graphs: [top]").graphs == (Graphed(module="top"),)  # a bare name is {module: top}
    assert "graphs" not in ErasePlan().to_dict()  # plans without graphed pieces keep their old text
    assert ErasePlan(graphs=(Graphed(module="x"),)).exact and not plan.exact
    assert plan.detach_only().graphs == () and plan.without_cuts().graphs == ()


@pytest.mark.parametrize("text, needle", [
    ("graphs: [{module: a, stream: 3}]\nnum_streams: 1", "graphs[0].stream: 3 is out of range 0..1"),
    ("graphs: [{module: a}]\ncuts: [a.b]", "overlaps"),
    ("graphs: [{module: a, graph: true}]", "graphs[0].graph: unknown field"),
    ("graphs: [{module: 'a b'}]", "graphs[0].module"),
    ("graphs: {module: a}", "graphs: must be a list"),
])
def test_graphed_errors_name_the_field(text, needle):
    with pytest.raises(PlanError, match=None) as info:
        ErasePlan.loads(text)
    assert needle in str(info.value)


def test_canonical_graphed_under_a_whole_step_graph_is_a_placement_or_nothing():
    plan = ErasePlan(graphs=(Graphed(module="a", stream=3), Graphed(module="b")), num_streams=3, whole_step_graph=True)
    canon = plan.canonical()
    assert canon.graphs == () and canon.placements == (Placement(module="a", stream=1),) and canon.num_streams == 1
    eager = ErasePlan(graphs=(Graphed(module="b", stream=4), Graphed(module="a")), num_streams=4).canonical()
    assert eager.graphs == (Graphed(module="a"), Graphed(module="b", stream=1)) and eager.num_streams == 1


def test_check_model_covers_graphed():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(PlanError, match=r"graphs\[0\]\.module"):
        ErasePlan(graphs=(Graphed(module="nope"),)).check_model(model)


def test_a_plan_for_the_bare_model_finds_its_modules_under_a_wrapper():
    from torch import nn

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.head = nn.Linear(2, 1)

    class Wrapper(nn.Module):  # as DDP holds its module, inside DMP's own wrapper
        def __init__(self) -> None:
            super().__init__()
            self._dmp_wrapped_module = nn.Module()
            self._dmp_wrapped_module.module = Inner()
            self.extra = nn.Linear(1, 1)

    plan = ErasePlan(cuts=(Cut(module="blocks.0:2"),), placements=(Placement(module="head", stream=1),),
                     graphs=(Graphed(module="extra"),), num_streams=1)
    moved = plan.under_wrapper(Wrapper())
    assert moved.cuts[0].module == "_dmp_wrapped_module.module.blocks.0:2"
    assert moved.placements[0].module == "_dmp_wrapped_module.module.head"
    assert moved.graphs[0].module == "extra"  # the wrapper's own module: as it is
    moved.check_model(Wrapper())
    unknown = ErasePlan(cuts=(Cut(module="nothere"),))
    assert unknown.under_wrapper(Wrapper()) == unknown
