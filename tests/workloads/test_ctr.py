"""CTR proxy: shapes, determinism, and that the synthetic data make the subarchs matter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from erase_tune.workloads import Workload, WorkloadData, get_workload
from erase_tune.workloads.ctr import CTRModel, synthetic_ctr

CPU = torch.device("cpu")
SMALL = {"batch": 32, "width": 16, "depth": 2, "emb_dim": 8, "num_tables": 5, "rows": 50, "sub_out": 4,
         "train_batches": 4, "eval_batches": 2}  # fmt: skip

# Sizes at which the teacher was tuned: trained vs frozen towers differ by 0.07-0.11 NE over
# seeds 0-3 at 400 steps (seed 0: 0.73 vs 0.83), so the asserted margins leave room.
LEARN = {"num_tables": 8, "rows": 20, "train_batches": 128, "seed": 0}
LEARN_STEPS = 400


def _train(wl: Workload, data: WorkloadData, steps: int, *, freeze_subarchs: bool = False) -> nn.Module:
    model = wl.build_model()
    if freeze_subarchs:
        model.subarchs.requires_grad_(False)
    opt = wl.optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        inputs, target = data.batch(step)
        loss = wl.loss_fn(model(*inputs), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def test_shapes_and_named_parts() -> None:
    wl = get_workload("ctr", SMALL)
    model = wl.build_model()
    assert isinstance(model, CTRModel)
    data = wl.make_data(CPU)
    (dense, sparse), labels = data.batch(0)
    assert dense.shape == (32, 13) and dense.dtype == torch.float32
    assert sparse.shape == (32, 5, 1) and sparse.dtype == torch.int64
    assert labels.shape == (32,) and set(labels.unique().tolist()) <= {0.0, 1.0}
    assert model(dense, sparse).shape == (32,)
    assert len(data.train) == 4 and len(data.eval) == 2
    assert model.sparse(sparse).shape == (32, 5, 8)
    assert model.dense(dense).shape == (32, 8)
    assert model.interaction(model.dense(dense), model.sparse(sparse)).shape == (32, 6 * 5 // 2)
    assert not list(model.interaction.parameters())
    # Every cut candidate is a one-tensor-in, one-tensor-out module on the shared features.
    modules = dict(model.named_modules())
    features = torch.randn(32, 6 * 8)
    assert wl.cut_candidates == tuple(f"subarchs.{i}" for i in range(6))
    for name in wl.cut_candidates:
        assert modules[name](features).shape == (32, 4)
    head = wl.make_head("subarchs.0", torch.randn(32, 4), torch.randn(32))
    assert head(torch.randn(32, 4)).shape == (32,)


def test_forward_calls_each_subarch_once_on_one_tensor() -> None:
    wl = get_workload("ctr", SMALL)
    model = wl.build_model()
    seen: list[tuple[int, tuple[int, ...]]] = []
    for i, arch in enumerate(model.subarchs):
        arch.register_forward_hook(lambda m, args, out, i=i: seen.append((i, (len(args), *out.shape))))
    (dense, sparse), _ = wl.make_data(CPU).batch(0)
    model(dense, sparse)
    assert seen == [(i, (1, 32, 4)) for i in range(6)]


def test_deterministic() -> None:
    wl = get_workload("ctr", SMALL)
    a, b = wl.build_model().state_dict(), wl.build_model().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = get_workload("ctr", {**SMALL, "seed": 1}).build_model().state_dict()
    assert not torch.equal(a["over.model.0.weight"], other["over.model.0.weight"])
    d1, d2 = wl.make_data(CPU), wl.make_data(CPU)
    for (x1, y1), (x2, y2) in zip([*d1.train, *d1.eval], [*d2.train, *d2.eval]):
        assert all(torch.equal(u, v) for u, v in zip(x1, x2)) and torch.equal(y1, y2)
    assert d1.prior_entropy == d2.prior_entropy


def test_building_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    get_workload("ctr", SMALL).build_model()
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_data_base_rate_and_ids() -> None:
    dense, sparse, labels = synthetic_ctr(20000, num_tables=4, rows=30, bag=3, base_rate=0.1, seed=5, device=CPU)
    assert dense.shape == (20000, 13) and sparse.shape == (20000, 4, 3) and labels.shape == (20000,)
    assert 0 <= int(sparse.min()) and int(sparse.max()) < 30
    assert abs(float(labels.mean()) - 0.1) < 0.01
    counts = torch.bincount(sparse[:, 0].flatten(), minlength=30)
    assert counts.max() > 5 * counts.float().median()  # popularity is heavy-headed


def _full_bisection(z: torch.Tensor, rate: float, iters: int = 60) -> torch.Tensor:
    """All ``iters`` steps, as on a GPU (no early stop)."""
    lo, hi = torch.full((), -40.0), torch.full((), 40.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_high = torch.sigmoid(z + mid).mean() > rate
        hi, lo = torch.where(too_high, mid, hi), torch.where(too_high, lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("rate", [1e-4, 0.03, 0.25, 0.5, 0.97])
@pytest.mark.parametrize("scale", [0.0, 0.3, 3.0, 40.0])
def test_the_bias_bisection_stops_early_on_the_cpu_with_the_same_bits(rate: float, scale: float) -> None:
    from erase_tune.workloads.ctr import _bias_for_rate

    z = scale * torch.randn(4096, generator=torch.Generator().manual_seed(7))
    assert torch.equal(_bias_for_rate(z, rate), _full_bisection(z, rate))
    assert _bias_for_rate(z, rate, iters=5).item() == _full_bisection(z, rate, iters=5).item()  # bounded by iters


def test_few_steps_reduce_loss() -> None:
    wl = get_workload("ctr", SMALL)
    data = wl.make_data(CPU)
    model = wl.build_model()
    inputs, target = data.batch(0)
    with torch.no_grad():
        before = float(wl.loss_fn(model(*inputs), target))
    opt = wl.optimizer(model.parameters())
    assert not opt.defaults.get("fused")  # fused Adam is for CUDA parameters only
    for _ in range(20):
        loss = wl.loss_fn(model(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(wl.loss_fn(model(*inputs), target)) < before


@pytest.fixture(scope="module")
def trained_vs_frozen() -> tuple[float, float]:
    """Held-out NE after the same short run with the subarchs trained, and frozen at init."""
    wl = get_workload("ctr", LEARN)
    data = wl.make_data(CPU)
    trained = wl.normalized_entropy(_train(wl, data, LEARN_STEPS), data)
    frozen = wl.normalized_entropy(_train(wl, data, LEARN_STEPS, freeze_subarchs=True), data)
    print(f"\nctr held-out NE after {LEARN_STEPS} steps: trained subarchs {trained:.4f}, frozen {frozen:.4f}")
    return trained, frozen


def test_model_learns(trained_vs_frozen: tuple[float, float]) -> None:
    trained, _ = trained_vs_frozen
    assert trained < 0.9


def test_frozen_subarchs_cost_ne(trained_vs_frozen: tuple[float, float]) -> None:
    # The synthetic teacher has a part only trained towers can fit: without it, detaching
    # every subarch would be free and the tuning problem trivial.
    trained, frozen = trained_vs_frozen
    assert frozen - trained >= 0.02
