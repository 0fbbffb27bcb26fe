"""The dlrm workload: the reference DLRM's layout, its host-built interaction index, training
that learns, bottom MLPs that matter, arguments refused in one line, Criteo files."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from erase_tune.errors import PlanError, WorkloadError
from erase_tune.runtime import Cut, EraseEngine, ErasePlan, Graphed, Placement, probe
from erase_tune.workloads import get_workload
from erase_tune.workloads.dlrm import DLRM_Net, _parameter_count
from tests.workloads.test_criteo import _write_tsv
from tests.workloads.training import refused, train

CPU = torch.device("cpu")
SMALL = {"batch": 32, "rows": 50, "emb_dim": 4, "num_tables": 5, "bot_mlp": "16-4", "top_mlp": "16-8-1",
         "train_batches": 4, "eval_batches": 2}  # fmt: skip
# Sizes at which bottom MLPs trained for 300 steps beat ones frozen at init by 0.03-0.09 held-out
# NE over seeds 0-2 on a CPU (seed 0: 0.862 vs 0.911): four tables of 50 rows, dim 4 < 13 dense
# features, so a frozen bottom MLP loses part of what the teacher's dense part needs.
LEARN = {"batch": 256, "rows": 50, "emb_dim": 4, "num_tables": 4, "bot_mlp": "16-4", "top_mlp": "16-1",
         "train_batches": 300, "eval_batches": 8}  # fmt: skip
LEARN_STEPS = 300


def _raises(match: str, **args) -> str:
    return refused("dlrm", match, **args)


def test_the_reference_layout() -> None:
    wl = get_workload("dlrm", SMALL)
    model = wl.build_model()
    assert isinstance(model, DLRM_Net)
    assert [type(m) for m in model.bot_l] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU]
    assert [m.out_features for m in model.bot_l if isinstance(m, nn.Linear)] == [16, 4]
    assert model.bot_l[0].in_features == 13
    assert len(model.emb_l) == 5
    for table in model.emb_l:
        assert isinstance(table, nn.EmbeddingBag) and table.sparse and table.mode == "sum"
        assert table.weight.shape == (50, 4)
    assert [type(m) for m in model.top_l] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear, nn.Sigmoid]
    assert model.top_l[0].in_features == 4 + 6 * 5 // 2  # the dense vector and the lower triangle
    data = wl.make_data(CPU)
    (dense, offsets, ids), labels = data.batch(0)
    assert dense.shape == (32, 13) and dense.dtype == torch.float32
    assert offsets.shape == ids.shape == (5, 32) and ids.dtype == offsets.dtype == torch.int64
    assert torch.equal(offsets[2], torch.arange(32)) and 0 <= int(ids.min()) and int(ids.max()) < 50
    assert set(labels.unique().tolist()) <= {0.0, 1.0}
    assert len(data.train) == 4 and len(data.eval) == 2
    out = model(dense, offsets, ids)
    assert out.shape == (32,) and bool(((out > 0) & (out < 1)).all())
    assert wl.cut_candidates == ("bot_l", "bot_l.0:2", "top_l", "top_l.0:4")
    assert isinstance(wl.optimizer(model.parameters()), torch.optim.SGD)
    example = wl.example(CPU)
    assert [(t.shape, t.dtype) for t in (*example[0], example[1])] == [(t.shape, t.dtype) for t in (dense, offsets,
                                                                                                      ids, labels)]


def test_the_candidates_are_placed_or_graphed_and_only_the_bottom_mlp_detached() -> None:
    wl = get_workload("dlrm", SMALL)
    model = wl.build_model()
    found = probe(model, tuple(wl.example(CPU)[0]), wl.cut_candidates)
    for c in wl.cut_candidates:
        found.check_placement(c)
        found.check_graphed(c)
    for c in ("bot_l", "bot_l.0:2"):
        found.check_plan(ErasePlan(cuts=(Cut(module=c),)))
    with pytest.raises(PlanError, match=r"^cut 'top_l' produces the model's output"):
        found.check_cut("top_l")
    starved = found.untrained(ErasePlan(cuts=(Cut(module="bot_l"), Cut(module="top_l.0:4"))))
    assert starved == tuple(f"emb_l.{t}.weight" for t in range(5))  # nothing else trains the tables


def test_the_interaction_is_the_references_lower_triangle() -> None:
    model = get_workload("dlrm", SMALL).build_model()
    x = torch.randn(3, 4)
    ly = [torch.randn(3, 4) for _ in range(5)]
    out = model.interact_features(x, ly)
    vectors = [x, *ly]
    pairs = [(vectors[i] * vectors[j]).sum(-1) for i in range(6) for j in range(i)]  # (1,0), (2,0), (2,1), ...
    torch.testing.assert_close(out, torch.cat([x, torch.stack(pairs, dim=1)], dim=1))


def test_each_forward_builds_its_index_tensors_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps the whole step out of one CUDA graph: new host tensors in every forward."""
    wl = get_workload("dlrm", SMALL)
    model = wl.build_model()
    inputs, _ = wl.make_data(CPU).batch(0)
    made: list[torch.Tensor] = []
    real = torch.tensor

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch, "tensor", counting)
    for calls in (1, 2):
        model(*inputs)
        assert len(made) == 2 * calls and all(t.device.type == "cpu" for t in made)


@pytest.mark.gpu
def test_the_step_cannot_be_captured_whole_on_cuda() -> None:
    wl = get_workload("dlrm", SMALL)
    model = wl.build_model().cuda()
    inputs, _ = wl.example(torch.device("cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(*inputs)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(RuntimeError, match="(?i)captur"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(*inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [
    ErasePlan(graphs=(Graphed(module="top_l"),)),
    ErasePlan(graphs=(Graphed(module="top_l", stream=1),), placements=(Placement(module="bot_l", stream=2),),
              num_streams=2),
    ErasePlan(graphs=(Graphed(module="top_l.0:4"), Graphed(module="bot_l", stream=1)), num_streams=1),
], ids=["top_l", "top_l-side-stream-bot_l-placed", "top_l.0:4-and-bot_l"])  # fmt: skip
def test_graphing_parts_of_the_step_trains_like_the_plain_loop_on_cuda(plan: ErasePlan) -> None:
    """The lever this model has: graphed pieces inside its eager step, gradients unchanged."""
    cuda = torch.device("cuda")
    wl = get_workload("dlrm", {**SMALL, "train_batches": 12})
    data = wl.make_data(cuda)
    engines = [EraseEngine(wl.build_model().to(cuda), p, loss_fn=wl.loss_fn, optimizer=wl.optimizer,
                           example=wl.example(cuda)) for p in (ErasePlan(), plan)]  # fmt: skip
    for step in range(12):  # past warm-up and capture: the last steps are replays
        plain, graphed = (float(e.step(*data.batch(step))) for e in engines)
        assert graphed == pytest.approx(plain, rel=1e-5, abs=1e-6), step
    for (name, p), (_, q) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    for engine in engines:
        engine.close()


def test_deterministic_and_seeded() -> None:
    wl = get_workload("dlrm", SMALL)
    a, b = wl.build_model().state_dict(), wl.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = get_workload("dlrm", {**SMALL, "seed": 1}).build_model().state_dict()
    assert not torch.equal(a["top_l.0.weight"], other["top_l.0.weight"])
    d1, d2 = wl.make_data(CPU), wl.make_data(CPU)
    for (x1, y1), (x2, y2) in zip([*d1.train, *d1.eval], [*d2.train, *d2.eval]):
        assert all(torch.equal(u, v) for u, v in zip(x1, x2)) and torch.equal(y1, y2)


@pytest.mark.parametrize("args", [SMALL, {}, {"num_tables": 1, "bot_mlp": "3", "emb_dim": 3, "top_mlp": "1"}])
def test_the_memory_estimate_counts_the_model_that_is_built(args: dict) -> None:
    wl = get_workload("dlrm", {**args, "rows": 7})
    tables, mlps = _parameter_count(dict(wl.args))
    model = wl.build_model()
    assert tables == sum(p.numel() for p in model.emb_l.parameters())
    assert tables + mlps == sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def trained_vs_frozen() -> tuple[float, float, float]:
    """Held-out NE at init, after training, and after training with bot_l frozen at init."""
    wl = get_workload("dlrm", LEARN)
    data = wl.make_data(CPU)
    model = wl.build_model()
    at_init = wl.normalized_entropy(model, data)
    losses = train(wl, data, model, LEARN_STEPS)
    assert losses[-1] < losses[0]
    frozen = wl.build_model()
    frozen.bot_l.requires_grad_(False)
    train(wl, data, frozen, LEARN_STEPS, wl.optimizer([p for p in frozen.parameters() if p.requires_grad]))
    return at_init, wl.normalized_entropy(model, data), wl.normalized_entropy(frozen, data)


def test_training_brings_ne_below_the_prior(trained_vs_frozen: tuple[float, float, float]) -> None:
    at_init, trained, _ = trained_vs_frozen
    assert trained < 0.95 < at_init  # 1.0 is the constant predictor at the base rate


def test_the_bottom_mlp_matters(trained_vs_frozen: tuple[float, float, float]) -> None:
    _, trained, frozen = trained_vs_frozen
    assert frozen - trained > 0.03, (trained, frozen)


def test_bad_arguments_are_one_line() -> None:
    _raises(r"argument 'bot_mlp' must be layer sizes ending in emb_dim=8 \(the reference's rule\), got '512-256-128'$",
            emb_dim=8)
    _raises(r"argument 'top_mlp' must be layer sizes ending in 1 .*, got '64-2'$", top_mlp="64-2")
    for bad in ("", "512--1", "512-x-1", "1e3-1", "-1", " 1", "1-0", "70000-1", "-".join(["4"] * 65), "1" * 500):
        _raises(r"argument 'top_mlp' must be layer sizes like '512-256-128' \(at most 64 layers of 1..65536\)",
                top_mlp=bad)
    _raises(r"argument 'batch' must be an integer >= 1, got 0$", batch=0)
    _raises(r"argument 'num_tables' must be an integer <= 1024, got 1025$", num_tables=1025)
    _raises(r"argument 'lr' must be a finite number > 0, got -1.0$", lr=-1.0)
    _raises(r"argument 'data' must be 'synthetic' or the path of a readable Criteo TSV file", data="/no/such.tsv")
    _raises(r"argument 'bot_mlp' must be str, got int 128$", bot_mlp=128)
    _raises(r"num_tables=26 x rows=1000000000000 x emb_dim=128 needs about 13 PB for the embedding tables",
            rows=10**12)


def test_a_criteo_file_is_read(tmp_path: Path) -> None:
    path = _write_tsv(tmp_path / "day.tsv", 100)
    args = {**SMALL, "num_tables": 26, "rows": 1000, "batch": 16, "train_batches": 5, "eval_batches": 1,
            "data": str(path)}  # fmt: skip
    wl = get_workload("dlrm", args)
    data = wl.make_data(CPU)
    assert len(data.train) == 5 and sum(len(y) for _, y in data.eval) == 16  # 96 lines read, the last 16 held out
    (dense, offsets, ids), labels = data.batch(0)
    assert dense.shape == (16, 13) and offsets.shape == ids.shape == (26, 16)
    first = path.read_text().splitlines()[0].split("\t")
    assert labels[0] == float(first[0])
    assert [int(ids[t, 0]) for t in range(26)] == [zlib.crc32(c.encode()) % 1000 if c else 0 for c in first[14:]]
    example = wl.example(CPU)
    assert all(torch.equal(u, v) for u, v in zip(example[0], (dense, offsets, ids)))
    losses = train(wl, data, wl.build_model(), 5)
    assert all(torch.isfinite(torch.tensor(losses)))
    _raises(r"argument 'num_tables' must be 26 with Criteo data, got 5$", **{**args, "num_tables": 5})
    with pytest.raises(WorkloadError, match=r"^workload 'dlrm': data .* has 100 lines, too few for one training batch"):
        get_workload("dlrm", {**args, "batch": 128}).example(CPU)


def test_bench_cuts_only_what_can_be_detached_together() -> None:
    """`erase-tune bench --workload dlrm` without --cuts: the top MLP produces the output and its
    first layers would starve the embeddings, so bench cuts the bottom MLP alone."""
    from erase_tune.measure.bench import detachable

    wl = get_workload("dlrm", SMALL)
    data, model = wl.make_data(torch.device("cpu")), wl.build_model()
    assert detachable(wl.cut_candidates, model, wl, data) == ["bot_l"]
    assert detachable(["top_l", "top_l.0:4"], model, wl, data) == []
