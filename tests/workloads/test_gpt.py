"""GPT proxy: shapes, causality, block chaining, held-out text, a few steps of learning."""

from __future__ import annotations

import math

import pytest
import torch

from erase_tune.workloads import get_workload
from erase_tune.workloads.gpt import GPT, Embed, cut_candidates, stdlib_text
from tests.workloads.training import train

CPU = torch.device("cpu")
SMALL = {"batch": 4, "seq_len": 32, "n_layer": 3, "n_head": 2, "n_embd": 32, "train_batches": 6, "eval_batches": 2}


def test_shapes_and_cut_candidates() -> None:
    wl = get_workload("gpt", SMALL)
    model = wl.build_model()
    assert isinstance(model, GPT)
    data = wl.make_data(CPU)
    (idx,), target = data.batch(0)
    assert idx.shape == (4, 32) and idx.dtype == torch.int64 and target.shape == (4, 32)
    assert torch.equal(idx[:, 1:], target[:, :-1])  # target is the input shifted by one byte
    assert model(idx).shape == (4, 32, 256)
    assert len(data.train) == 6 and len(data.eval) == 2
    assert 0 < data.prior_entropy < math.log(256)
    assert wl.cut_candidates == ("blocks.0:3", "blocks.3:4", "blocks.1", "blocks.2")
    modules = dict(model.named_modules())
    for name in wl.cut_candidates:
        assert name.split(":")[0] in modules


def test_cut_candidates() -> None:
    # Pieces of two blocks in chain order, the first with the embedding, then single blocks.
    assert cut_candidates(6) == (
        "blocks.0:3", "blocks.3:5", "blocks.5:7",
        "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5", "blocks.6",
    )  # fmt: skip
    assert cut_candidates(4) == ("blocks.0:3", "blocks.3:5", "blocks.1", "blocks.2", "blocks.3", "blocks.4")
    assert cut_candidates(2) == ("blocks.0:3", "blocks.1", "blocks.2")
    assert cut_candidates(1) == ("blocks.0:2", "blocks.1")


def test_blocks_are_a_plain_chain() -> None:
    # A run of blocks is a cut only if the model calls them as x = b(x); check the forward
    # equals that chain done by hand, starting from the embedding (the chain's first block).
    wl = get_workload("gpt", SMALL)
    model = wl.build_model()
    (idx,), _ = wl.make_data(CPU).batch(0)
    embed, *blocks = model.blocks
    assert isinstance(embed, Embed) and len(blocks) == SMALL["n_layer"]
    with torch.no_grad():
        x = embed(idx)
        assert torch.equal(x, embed.wte(idx) + embed.wpe(torch.arange(idx.shape[1])))
        for block in blocks:
            y = block(x)
            assert y.shape == x.shape
            x = y
        by_hand = model.lm_head(torch.nn.functional.rms_norm(x, (x.shape[-1],)))
        assert torch.allclose(model(idx), by_hand, atol=1e-6)


def test_causal() -> None:
    model = get_workload("gpt", SMALL).build_model()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(idx)[:, :10], model(changed)[:, :10], atol=1e-6)


def test_deterministic_and_held_out_is_disjoint() -> None:
    wl = get_workload("gpt", SMALL)
    a, b = wl.build_model().state_dict(), wl.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    d1, d2 = wl.make_data(CPU), wl.make_data(CPU)
    assert all(torch.equal(x1[0], x2[0]) for (x1, _), (x2, _) in zip(d1.train, d2.train))
    # Train windows tile the first 24·33 bytes (shuffled); held-out windows are the next ones, in order.
    length, n_train = 33, 24
    text = torch.frombuffer(bytearray(stdlib_text((24 + 8) * length)), dtype=torch.uint8).long()
    train = torch.cat([torch.cat([x[0][:, :1], y], 1) for x, y in d1.train])
    held = torch.cat([torch.cat([x[0][:, :1], y], 1) for x, y in d1.eval])
    tiles = text[: n_train * length].view(n_train, length)
    assert sorted(map(tuple, train.tolist())) == sorted(map(tuple, tiles.tolist()))
    assert torch.equal(held.flatten(), text[n_train * length :])


def test_few_steps_reduce_loss() -> None:
    wl = get_workload("gpt", {**SMALL, "lr": 3e-3})
    data = wl.make_data(CPU)
    model = wl.build_model()
    opt = wl.optimizer(model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    before = wl.normalized_entropy(model, data)
    train(wl, data, model, 30, opt)
    after = wl.normalized_entropy(model, data)
    assert after < before and after < 1.0  # better than the byte-frequency prior


def test_bf16_compute_is_an_argument_and_float32_stays_the_default():
    import torch

    from erase_tune.errors import WorkloadError
    from erase_tune.workloads import get_workload

    small = {"batch": 2, "seq_len": 8, "n_layer": 1, "n_head": 2, "n_embd": 16, "train_batches": 1, "eval_batches": 1}
    seen = {}
    for dtype in ("float32", "bfloat16"):
        wl = get_workload("gpt", {**small, "dtype": dtype})
        model = wl.build_model()
        (idx,), _ = wl.example(torch.device("cpu"))
        hook = model.lm_head.register_forward_hook(lambda m, a, out, d=dtype: seen.__setitem__(d, out.dtype))
        logits = model(idx)
        hook.remove()
        assert logits.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    assert seen == {"float32": torch.float32, "bfloat16": torch.bfloat16}
    assert get_workload("gpt", small).args["dtype"] == "float32"
    with pytest.raises(WorkloadError, match="argument 'dtype' must be"):
        get_workload("gpt", {**small, "dtype": "float16"})
