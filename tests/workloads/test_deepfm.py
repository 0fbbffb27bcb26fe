"""The deepfm workload: pytorch-fm's DeepFM layout, the teacher's clicks, training that learns,
an FM and an MLP that both matter, arguments refused in one line, and plans of its branches
that the runtime and the space check accept (and the ones they must not)."""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from torch import nn

from erase_tune.errors import EraseTuneError, PlanError
from erase_tune.runtime import Cut, EraseEngine, ErasePlan, Graphed, Placement, probe
from erase_tune.measure.trial import Budget, run_trial
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.space import SearchSpace
from erase_tune.workloads import BUILTINS, get_workload, module_of
from erase_tune.workloads.deepfm import (
    DeepFactorizationMachineModel,
    FactorizationMachine,
    FeaturesEmbedding,
    FeaturesLinear,
    MultiLayerPerceptron,
    _parameter_count,
)
from tests.runtime.test_engine import engine_grads, reference_grads
from tests.workloads.footprint import measure
from tests.workloads.training import refused, train

CPU = torch.device("cpu")
MB = 10**6
SPACES = Path(__file__).resolve().parents[2] / "search_spaces"
SMALL = {"batch": 32, "num_fields": 5, "rows": 50, "emb_dim": 4, "mlp": "16-8", "train_batches": 4,
         "eval_batches": 2}  # fmt: skip
# Sizes at which DeepFM trained for 300 steps beats both its own parts (CPU, one thread): without
# its FM branch by 0.050 / 0.015 / 0.027 held-out NE for seeds 0 / 1 / 2, without its MLP branch
# by 0.031 / 0.023 / 0.039 (seed 0: 0.717 against 0.767 and 0.748; the teacher's Bayes NE is 0.6).
LEARN = {"batch": 256, "num_fields": 8, "rows": 50, "emb_dim": 8, "mlp": "32-32", "train_batches": 300,
         "eval_batches": 16, "lr": 1e-2}  # fmt: skip
LEARN_STEPS = 300


def _raises(match: str, **args) -> str:
    return refused("deepfm", match, **args)


def _float64(batch):
    """A batch for a float64 model: the ids as they are, the labels in float64."""
    (ids,), labels = batch
    return (ids,), labels.double()


# ---------------------------------------------------------------------------------------
# Layout, shapes, data
# ---------------------------------------------------------------------------------------


def test_the_pytorch_fm_layout() -> None:
    wl = get_workload("deepfm", SMALL)
    model = wl.build_model()
    assert isinstance(model, DeepFactorizationMachineModel)
    assert [name for name, _ in model.named_children()] == ["linear", "fm", "embedding", "mlp"]
    assert isinstance(model.embedding, FeaturesEmbedding) and isinstance(model.linear, FeaturesLinear)
    assert isinstance(model.fm, FactorizationMachine) and isinstance(model.mlp, MultiLayerPerceptron)
    # One table over all fields' rows for the embedding; another, of scalars, for the linear term.
    assert model.embedding.embedding.weight.shape == (5 * 50, 4)
    assert model.linear.fc.weight.shape == (5 * 50, 1) and model.linear.bias.shape == (1,)
    assert not list(model.fm.parameters())
    kinds = [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout]
    assert [type(m) for m in model.mlp.mlp] == kinds + kinds + [nn.Linear]
    assert [m.out_features for m in model.mlp.mlp if isinstance(m, nn.Linear)] == [16, 8, 1]
    assert model.mlp.mlp[0].in_features == 5 * 4
    assert all(m.p == 0.0 for m in model.mlp.mlp if isinstance(m, nn.Dropout))
    assert wl.cut_candidates == ("linear", "mlp", "fm")
    assert wl.loss_fn is torch.nn.functional.binary_cross_entropy_with_logits
    assert isinstance(wl.optimizer(model.parameters()), torch.optim.Adam)


def test_each_part_has_its_documented_shape() -> None:
    wl = get_workload("deepfm", SMALL)
    model = wl.build_model()
    data = wl.make_data(CPU)
    (ids,), labels = data.batch(0)
    assert ids.shape == (32, 5) and ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 50
    assert labels.shape == (32,) and labels.dtype == torch.float32 and set(labels.unique().tolist()) <= {0.0, 1.0}
    assert len(data.train) == 4 and len(data.eval) == 2
    seen: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def record(name: str, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen[name] = (tuple(args[0].shape), tuple(out.shape))

    for name in ("embedding", "linear", "fm", "mlp"):
        getattr(model, name).register_forward_hook(functools.partial(record, name))
    out = model(ids)
    assert seen == {"embedding": ((32, 5), (32, 5, 4)), "linear": ((32, 5), (32, 1)),
                    "fm": ((32, 5, 4), (32, 1)), "mlp": ((32, 20), (32, 1))}  # fmt: skip
    assert out.shape == (32,) and out.dtype == torch.float32  # logits: the loss takes them as they are
    example = wl.example(CPU)
    assert [(t.shape, t.dtype) for t in (*example[0], example[1])] == [(ids.shape, ids.dtype),
                                                                       (labels.shape, labels.dtype)]


def test_the_offsets_put_each_field_in_its_own_rows() -> None:
    model = get_workload("deepfm", SMALL).build_model()
    ids = torch.tensor([[0, 1, 2, 3, 49]])
    rows = torch.tensor([0, 51, 102, 153, 249])  # field f's id i is row 50·f + i
    torch.testing.assert_close(model.embedding(ids)[0], model.embedding.embedding.weight[rows])
    with torch.no_grad():
        model.linear.fc.weight.copy_(torch.arange(250.0).unsqueeze(1))
        model.linear.bias.fill_(0.5)
    assert model.linear(ids).item() == float(rows.sum()) + 0.5


def test_the_fm_is_the_sum_of_pairwise_dot_products() -> None:
    v = torch.randn(3, 5, 4, dtype=torch.float64)
    pairs = sum((v[:, i] * v[:, j]).sum(-1) for i in range(5) for j in range(i + 1, 5))
    torch.testing.assert_close(FactorizationMachine()(v), pairs.unsqueeze(1))


def test_the_teacher_clicks_at_a_realistic_rate_on_skewed_ids() -> None:
    wl = get_workload("deepfm", {**SMALL, "batch": 512, "rows": 1000, "train_batches": 16})
    data = wl.make_data(CPU)
    ids = torch.cat([x for (x,), _ in data.train])
    labels = torch.cat([y for _, y in data.train])
    assert 0.22 < float(labels.mean()) < 0.28
    # Zipf-like: each field's most popular id takes far more than its uniform share (1 in 1000).
    for f in range(5):
        top = torch.bincount(ids[:, f], minlength=1000).max().item() / len(ids)
        assert top > 0.05, (f, top)
    assert 0.9 < data.prior_entropy / (-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))) < 1.1


def test_deterministic_and_seeded() -> None:
    wl = get_workload("deepfm", SMALL)
    a, b = wl.build_model().state_dict(), wl.build_model().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = get_workload("deepfm", {**SMALL, "seed": 1})
    assert not torch.equal(a["mlp.mlp.0.weight"], other.build_model().state_dict()["mlp.mlp.0.weight"])
    d1, d2, d3 = wl.make_data(CPU), wl.make_data(CPU), other.make_data(CPU)
    for (x1, y1), (x2, y2) in zip([*d1.train, *d1.eval], [*d2.train, *d2.eval]):
        assert torch.equal(x1[0], x2[0]) and torch.equal(y1, y2)
    assert not torch.equal(d1.train[0][0][0], d3.train[0][0][0])


@pytest.mark.parametrize("args", [SMALL, {}, {"num_fields": 1, "emb_dim": 1, "mlp": "1"}])
def test_the_memory_estimate_counts_the_model_that_is_built(args: dict) -> None:
    wl = get_workload("deepfm", {**args, "rows": 7})
    embedding, linear, mlp = _parameter_count(dict(wl.args))
    model = wl.build_model()
    assert embedding == sum(p.numel() for p in model.embedding.parameters())
    assert linear == sum(p.numel() for p in model.linear.parameters())
    assert mlp == sum(p.numel() for p in model.mlp.parameters())
    assert embedding + linear + mlp == sum(p.numel() for p in model.parameters())


def test_the_example_is_cheap_at_gpu_sizes() -> None:
    # Building the workload and one example batch in a fresh process at the GPU space's sizes:
    # the per-field id order (26 x 100,000) and one batch, not the pools (512 batches of 4096:
    # 436 MB of ids), in CPU time and memory, which a loaded machine does not stretch.
    (result,) = measure([{"name": "deepfm", "args": {"train_batches": 512, "eval_batches": 16}, "example": True}])
    assert result["error"] is None, result["error"]
    assert result["cpu_seconds"] < 1.5 and result["grew"] < 200 * MB, result


# ---------------------------------------------------------------------------------------
# Training, and what each branch is worth
# ---------------------------------------------------------------------------------------


def _without(name: str, model: nn.Module) -> nn.Module:
    """The model with branch ``name`` contributing nothing (a zero logit)."""
    getattr(model, name).forward = lambda x: x.new_zeros(x.shape[0], 1)
    return model


@pytest.fixture(scope="module")
def learned() -> dict[str, float]:
    """Held-out NE at init and after training DeepFM, DeepFM without its FM and without its MLP."""
    torch.set_num_threads(1)  # the numbers above were measured on one thread
    wl = get_workload("deepfm", LEARN)
    data = wl.make_data(CPU)
    model = wl.build_model()
    out = {"init": wl.normalized_entropy(model, data)}
    losses = train(wl, data, model, LEARN_STEPS)
    out["loss_first"], out["loss_last"] = losses[0], sum(losses[-20:]) / 20
    out["trained"] = wl.normalized_entropy(model, data)
    for branch in ("fm", "mlp"):
        ablated = _without(branch, wl.build_model())
        train(wl, data, ablated, LEARN_STEPS)
        out[f"no_{branch}"] = wl.normalized_entropy(ablated, data)
    return out


def test_training_brings_ne_below_the_prior(learned: dict[str, float]) -> None:
    assert learned["loss_last"] < 0.8 * learned["loss_first"]
    assert learned["trained"] < 0.8 < learned["init"]  # 1.0 is the constant predictor at the base rate


def test_the_fm_and_the_mlp_both_matter(learned: dict[str, float]) -> None:
    assert learned["no_fm"] - learned["trained"] > 0.02, learned
    assert learned["no_mlp"] - learned["trained"] > 0.015, learned


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------


def test_bad_arguments_are_one_line() -> None:
    for bad in ("", "400--400", "400-x", "1e3", "-1", " 1", "0-4", "70000", "-".join(["4"] * 65), "1" * 500):
        _raises(r"argument 'mlp' must be hidden widths like '400-400-400' \(1 to 64 layers of 1..65536\), got ",
                mlp=bad)
    _raises(r"argument 'mlp' must be str, got int 400$", mlp=400)
    _raises(r"argument 'batch' must be an integer >= 2, got 1$", batch=1)  # BatchNorm1d needs two
    _raises(r"argument 'num_fields' must be an integer <= 1024, got 1025$", num_fields=1025)
    _raises(r"argument 'rows' must be an integer >= 1, got 0$", rows=0)
    _raises(r"argument 'emb_dim' must be int, got float 2.0$", emb_dim=2.0)
    _raises(r"argument 'dropout' must be a number in \[0, 1\), got 1.0$", dropout=1.0)
    _raises(r"argument 'dropout' must be a number in \[0, 1\), got nan$", dropout=float("nan"))
    _raises(r"argument 'lr' must be a finite number > 0, got 0.0$", lr=0.0)
    _raises(r"unknown argument 'fields' \(arguments: batch, num_fields, rows, emb_dim, mlp, dropout, lr, ",
            fields=3)
    _raises(r"num_fields=26 x rows=1000000000000 x emb_dim=16 needs about 6.7 PB for the shared embedding",
            rows=10**12)
    _raises(r"batch=1048576 x \(train_batches=1048576 \+ eval_batches=8\) needs about .* for the train/eval pools",
            batch=2**20, train_batches=2**20)


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------


def test_it_is_a_builtin() -> None:
    assert "deepfm" in BUILTINS and module_of("deepfm") == "erase_tune.workloads.deepfm"
    wl = get_workload("deepfm", {"batch": 64, "rows": 10, "mlp": "8"})
    assert wl.name == "deepfm" and wl.batch_size == 64
    assert wl.args == {"batch": 64, "num_fields": 26, "rows": 10, "emb_dim": 16, "mlp": "8", "dropout": 0.0,
                       "lr": 1e-3, "train_batches": 64, "eval_batches": 8, "seed": 0}  # fmt: skip
    assert isinstance(get_workload("deepfm", {"dropout": 0}).args["dropout"], float)  # an int where a float goes


# ---------------------------------------------------------------------------------------
# Plans of its branches
# ---------------------------------------------------------------------------------------


def test_the_probe_accepts_each_branch_and_sees_the_shared_embedding() -> None:
    wl = get_workload("deepfm", SMALL)
    model = wl.build_model()
    found = probe(model, tuple(wl.example(CPU)[0]), wl.cut_candidates)
    for c in wl.cut_candidates:
        found.check_placement(c)
        found.check_graphed(c)
        found.check_cut(c)  # none of them is the whole output: the others still reach the loss
    found.check_plan(ErasePlan(cuts=(Cut(module="linear"), Cut(module="mlp"))))
    # The FM has no parameters: detached, it trains nothing, and with the MLP detached as well
    # nothing trains the shared embedding.
    assert found.untrained(ErasePlan(cuts=(Cut(module="fm"),))) == ()
    assert found.untrained(ErasePlan(cuts=(Cut(module="mlp"), Cut(module="fm")))) == ("embedding.embedding.weight",)


def _engines(wl, plan: ErasePlan, example):
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    base = wl.build_model().double()
    plain = EraseEngine(copy.deepcopy(base), ErasePlan(), loss_fn=wl.loss_fn, optimizer=adam)
    other = EraseEngine(copy.deepcopy(base), plan, loss_fn=wl.loss_fn, optimizer=adam, example=example)
    return plain, other


@pytest.mark.parametrize("plan", [
    ErasePlan(graphs=(Graphed(module="mlp"),)),
    ErasePlan(graphs=(Graphed(module="mlp", stream=1),), num_streams=1),
    ErasePlan(placements=(Placement(module="mlp", stream=1),), num_streams=1),
    ErasePlan(placements=(Placement(module="linear", stream=1), Placement(module="mlp", stream=2)),
              graphs=(Graphed(module="fm"),), num_streams=2, dispatch="threaded"),
], ids=["mlp-graphed", "mlp-graphed-side-stream", "mlp-placed", "all-three"])  # fmt: skip
def test_graphing_or_placing_branches_keeps_the_gradients(plan: ErasePlan) -> None:
    """On the CPU a graphed piece runs as it is and a placement on the one stream there is: the
    engine must accept the plan and train bit for bit like the plain loop."""
    wl = get_workload("deepfm", SMALL)
    data = wl.make_data(CPU)
    plain, other = _engines(wl, plan, _float64(data.batch(0)))
    for step in range(4):
        inputs, target = _float64(data.batch(step))
        for e in (plain, other):
            e.zero_grad()
        a, b = plain.forward_backward(inputs, target), other.forward_backward(inputs, target)
        assert torch.equal(a, b), step
        for (name, p), (_, q) in zip(plain.model.named_parameters(), other.model.named_parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        plain.optimizer.step()
        other.optimizer.step()
    for (name, p), (_, q) in zip(plain.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(p, q), name
    for (name, p), (_, q) in zip(plain.model.named_buffers(), other.model.named_buffers()):
        assert torch.equal(p, q), name  # BatchNorm's running statistics too
    other.close()


@pytest.mark.parametrize("dispatch", ["blocking", "threaded", "deferred"])
def test_detaching_branches_gives_the_reference_gradients(dispatch: str) -> None:
    wl = get_workload("deepfm", SMALL)
    model = wl.build_model().double()
    plan = ErasePlan(cuts=(Cut(module="linear", stream=1, aux_weight=0.5), Cut(module="mlp", stream=2)),
                     graphs=(Graphed(module="fm"),), num_streams=2, dispatch=dispatch)  # fmt: skip
    inputs, target = _float64(wl.make_data(CPU).batch(0))
    pristine = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=wl.loss_fn, example=(inputs, target))
    loss = engine.forward_backward(inputs, target)
    ref, ref_loss = reference_grads(pristine, engine.heads, plan, inputs, target, loss=wl.loss_fn)
    got = engine_grads(engine)
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        assert g is not None, name
        torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    engine.close()


# ---------------------------------------------------------------------------------------
# The shipped spaces
# ---------------------------------------------------------------------------------------


def test_the_spaces_offer_fm_no_detach_and_no_plan_that_starves_the_embedding() -> None:
    for stem in ("deepfm", "deepfm-smoke"):
        space = SearchSpace.load(SPACES / f"{stem}.yaml")
        assert space.workload.name == "deepfm" and space.gain_over == "eager" and space.seeds == ()
        assert space.budget.per_trial.windows == 4
        assert space.cuts.modules == ("linear", "mlp", "fm")
        assert [c.modes for c in space.cuts.candidates] == [None, None, ("keep", "place", "graph")]
    bound = check_space(SearchSpace.load(SPACES / "deepfm-smoke.yaml"))
    assert dict(bound.modes) == {"linear": ("keep", "place", "detach", "graph"),
                                 "mlp": ("keep", "place", "detach", "graph"), "fm": ("keep", "place", "graph")}
    wl = get_workload("deepfm", bound.space.workload.args)
    found = probe(wl.build_model(), tuple(wl.example(CPU)[0]), bound.candidates)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    modes = set()
    for _ in range(200):
        plan = bound.plan(study.ask())
        found.check_plan(plan)  # every plan the search can propose is one the engine accepts
        modes |= {(c.module, "detach") for c in plan.cuts} | {(p.module, "place") for p in plan.placements}
        modes |= {(g.module, "graph") for g in plan.graphs}
    assert modes == {(c, m) for c in ("linear", "mlp", "fm") for m in ("detach", "place", "graph")} - {("fm", "detach")}


@pytest.mark.parametrize("candidates", [["linear", "fm", "mlp"], ["linear", "mlp", "fm"]])
def test_sibling_branches_may_each_be_detached_but_never_all_that_train_the_embedding(
        tmp_path: Path, candidates: list[str]) -> None:
    """Three branches over one embedding: detaching any one leaves the others training it, so a
    space listing all three for detach is accepted in any order; the search never proposes the
    plan that detaches both fm and mlp (nothing would train the embedding), and that plan, given
    directly, is refused in one line naming the cuts that cause it."""
    text = yaml.safe_load((SPACES / "deepfm-smoke.yaml").read_text())
    text["cuts"]["candidates"] = candidates
    path = tmp_path / "siblings.yaml"
    path.write_text(yaml.safe_dump(text))
    bound = check_space(SearchSpace.load(path))
    assert all(bound.can_detach((), c) for c in ("linear", "fm", "mlp"))
    assert not bound.can_detach((Cut(module="fm"),), "mlp") and not bound.can_detach((Cut(module="mlp"),), "fm")
    wl = get_workload("deepfm", dict(text["workload"]["args"]))
    found = probe(wl.build_model(), tuple(wl.example(CPU)[0]), bound.candidates)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    detached = set()
    for _ in range(200):
        plan = bound.plan(study.ask())
        found.check_plan(plan)  # every plan the search can propose is one the engine accepts
        detached.add(frozenset(c.module for c in plan.cuts))
    assert {frozenset({"fm"}), frozenset({"mlp"}), frozenset({"linear", "fm"}), frozenset({"linear", "mlp"})} <= detached
    assert not any({"fm", "mlp"} <= d for d in detached)
    with pytest.raises(PlanError, match=r"^plan leaves 1 parameters untrained: embedding.embedding.weight \(cuts "
                                        r"'(fm|mlp)', '(fm|mlp)' together detach everything upstream of them\)$"):
        found.check_plan(ErasePlan(cuts=(Cut(module="fm"), Cut(module="mlp"))))


def test_with_the_workloads_own_candidates_fm_is_detached_only_while_mlp_is_not(tmp_path: Path) -> None:
    text = yaml.safe_load((SPACES / "deepfm-smoke.yaml").read_text())
    text["cuts"]["candidates"] = []
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(text))
    bound = check_space(SearchSpace.load(path))
    assert bound.candidates == ["linear", "mlp", "fm"]
    assert bound.can_detach((), "mlp") and bound.can_detach((Cut(module="linear"),), "mlp")
    assert bound.can_detach((), "fm") and bound.can_detach((Cut(module="linear"),), "fm")
    assert not bound.can_detach((Cut(module="mlp"),), "fm")


def test_a_trial_of_the_smoke_space_runs_on_the_cpu() -> None:
    space = SearchSpace.load(SPACES / "deepfm-smoke.yaml")
    wl = get_workload(space.workload.name, space.workload.args)
    plan = ErasePlan(cuts=(Cut(module="mlp", stream=1),), placements=(Placement(module="linear", stream=2),),
                     graphs=(Graphed(module="fm"),), num_streams=2, dispatch="threaded")  # fmt: skip
    budget = Budget(warmup_steps=5, windows=4, window_steps=2, quality_steps=10)  # the space's, shorter
    result = run_trial(wl, plan, budget, device="cpu")
    assert result.workload == "deepfm" and math.isfinite(result.ne_gap) and result.ne_baseline < 1.2
    assert set(result.variants) == {"baseline", "candidate", "detach_only"}


# ---------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [
    ErasePlan(graphs=(Graphed(module="mlp"),)),
    ErasePlan(graphs=(Graphed(module="linear"), Graphed(module="fm", stream=1), Graphed(module="mlp", stream=2)),
              num_streams=2),
    ErasePlan(placements=(Placement(module="linear", stream=1), Placement(module="fm", stream=2)),
              graphs=(Graphed(module="mlp"),), num_streams=2),
], ids=["mlp", "all-three-graphed", "mlp-graphed-linear-fm-placed"])  # fmt: skip
def test_graphing_branches_trains_like_the_plain_loop_on_cuda(plan: ErasePlan) -> None:
    """SGD, not the workload's Adam: the bias of a Linear before BatchNorm1d has no true
    gradient, only rounding noise, which Adam turns into steps of ±lr. Captured on a side
    stream, cuBLAS may round differently, so under Adam ``mlp.mlp.0.bias`` parted by 1e-3 in 12
    steps (an H200, torch 2.11); under SGD every parameter stayed within 2e-8."""
    cuda = torch.device("cuda")
    wl = get_workload("deepfm", {**SMALL, "batch": 64, "train_batches": 12})
    data = wl.make_data(cuda)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    engines = [EraseEngine(wl.build_model().to(cuda), p, loss_fn=wl.loss_fn, optimizer=sgd,
                           example=wl.example(cuda)) for p in (ErasePlan(), plan)]  # fmt: skip
    for step in range(12):  # past warm-up and capture: the last steps are replays
        plain, graphed = (float(e.step(*data.batch(step))) for e in engines)
        assert graphed == pytest.approx(plain, rel=1e-5, abs=1e-6), step
    for (name, p), (_, q) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    for engine in engines:
        engine.close()


@pytest.mark.gpu
def test_the_whole_step_can_be_captured_on_cuda() -> None:
    """Unlike dlrm's: the offsets are a buffer, so no host tensor enters the step."""
    from erase_tune.measure.trial import reference_capture_error

    wl = get_workload("deepfm", {**SMALL, "batch": 64, "train_batches": 12})
    assert reference_capture_error(wl, torch.device("cuda")) is None
