"""ErasePlan: validation names the field at fault; YAML round trip; derived plans."""

from __future__ import annotations

import pytest
from torch import nn

from erase_tune import Cut, ErasePlan, PlanError


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
