"""Training a TorchRec model with an exported ERASE plan.

    python examples/train_torchrec.py --plan best.yaml [--steps 200] [--arg batch=512 ...] [--in-backward]

The model is TorchRec's own ``DLRM`` (an ``EmbeddingBagCollection`` over
``KeyedJaggedTensor`` ids, a dense arch, the dot interaction, an over arch that outputs
logits). ``workload`` below is its erase-tune workload factory: tune it with
``--workload train_torchrec:workload`` from this directory, export, and pass the plan here.
A plan whose provenance names another workload (``my_torchrec:workload`` in
docs/workloads.md) trains that one: whatever the provenance names must be importable.

``--in-backward``: the embedding tables are updated inside backward by TorchRec's
``apply_optimizer_in_backward`` (SGD), as production TorchRec jobs do; the engine's optimizer
then steps the dense parameters alone (the tables' ``.grad`` stays None), and the plan's
check still sees the tables as trained by any loss that reaches them.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time

import torch
import yaml
from torch import Tensor, nn

from erase_tune import EraseEngine, ErasePlan, EraseTuneError
from erase_tune.workloads import Workload, WorkloadData, get_workload
from erase_tune.workloads.base import prior_entropy

NUM_DENSE = 13


def _model(features: int, rows: int, dim: int, seed: int) -> nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    with torch.random.fork_rng(devices=[]):  # the same weights on every call, the caller's RNG untouched
        torch.manual_seed(seed)
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
                  for i in range(features)]
        return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=NUM_DENSE,
                    dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 1])


def _batches(n: int, batch: int, features: int, rows: int, seed: int, device: torch.device):
    """``((dense, ids), clicks)`` batches: the ids of each batch a KeyedJaggedTensor of 0..3 ids
    per feature and example, moved with ``.to(device)`` (a KJT is no tensor: keep what it returns)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    out, clicks = [], []
    weight = torch.randn(features, generator=g)
    for _ in range(0, n, batch):
        lengths = torch.randint(0, 4, (features, batch), generator=g)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        dense = torch.randn(batch, NUM_DENSE, generator=g)
        hot = torch.zeros(features, batch)  # a click is likelier when a feature holds a "hot" id (id % 7 == 0)
        rows_of = torch.repeat_interleave(torch.arange(features * batch), lengths.flatten())
        hot.view(-1).index_add_(0, rows_of, (values % 7 == 0).float())
        y = torch.bernoulli(torch.sigmoid(dense[:, 0] - dense[:, 1] + weight @ hot.clamp(max=1)), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(features)], values=values,
                                                  lengths=lengths.flatten())
        out.append(((dense.to(device), kjt.to(device)), y.to(device)))
        clicks.append(y)
    return out, torch.cat(clicks)


def _data(device: torch.device, *, batch: int, features: int, rows: int, steps: int, seed: int) -> WorkloadData:
    train, clicks = _batches(batch * steps, batch, features, rows, seed, device)
    held, _ = _batches(batch * 4, batch, features, rows, seed + 1, device)
    return WorkloadData(train=train, eval=held, prior_entropy=prior_entropy(clicks))


def bce_logits(logits: Tensor, clicks: Tensor) -> Tensor:
    """DLRM outputs logits (B, 1); the clicks are (B,)."""
    return nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), clicks)


def flat_head(name: str, cut_out: Tensor, model_out: Tensor) -> nn.Module:
    """An aux head for any cut: sparse_arch returns (B, features, dim), a 3-D output the default
    linear head would map to (B, features, 1) instead of the model's (B, 1)."""
    return nn.Sequential(nn.Flatten(1), nn.Linear(math.prod(cut_out.shape[1:]), model_out.shape[-1]))


def workload(*, batch: int = 256, features: int = 4, rows: int = 1000, dim: int = 16, steps: int = 128,
             lr: float = 0.1, seed: int = 0) -> Workload:
    """TorchRec's DLRM on synthetic clicks, as an erase-tune workload (``train_torchrec:workload``)."""
    make_data = functools.partial(_data, batch=batch, features=features, rows=rows, steps=steps, seed=seed)
    return Workload(
        name="train_torchrec:workload",
        args={"batch": batch, "features": features, "rows": rows, "dim": dim, "steps": steps, "lr": lr, "seed": seed},
        build_model=functools.partial(_model, features, rows, dim, seed),
        loss_fn=bce_logits,
        make_data=make_data,
        make_example=lambda device: _batches(batch, batch, features, rows, seed, device)[0][0],
        cut_candidates=("dense_arch", "sparse_arch"),
        batch_size=batch,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        make_head=flat_head,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--in-backward", action="store_true", help="update the tables inside backward")
    ns = parser.parse_args(argv)
    try:
        plan = ErasePlan.load(ns.plan)
        args = dict(plan.provenance.get("workload_args") or {})
        for pair in ns.arg:
            key, _, value = pair.partition("=")
            args[key] = yaml.safe_load(value)
        wl = get_workload(plan.provenance.get("workload") or "train_torchrec:workload", args)
        device = torch.device("cpu")  # torchrec's CPU build (fbgemm-gpu-cpu)
        data = wl.make_data(device)
        model = wl.build_model().to(device)
        if ns.in_backward:
            from torchrec.optim import apply_optimizer_in_backward

            tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
            apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": wl.args.get("lr", 0.1)})
        engine = EraseEngine(model, plan, loss_fn=wl.loss_fn, optimizer=wl.optimizer, example=data.batch(0),
                             make_head=wl.make_head, output=wl.output, model_loss=wl.model_loss)
    except EraseTuneError as e:
        print(f"train_torchrec: error: {e}", file=sys.stderr)
        return 2
    print(f"training {wl.name} with plan: {plan.describe()}" + (" (tables updated in backward)" if ns.in_backward else ""))
    ne0 = wl.normalized_entropy(model, data)
    start = time.perf_counter()
    for step in range(ns.steps):
        inputs, target = data.batch(step)
        loss = engine.step(inputs, target)
        if (step + 1) % max(1, ns.steps // 5) == 0:
            print(f"  step {step + 1:>5}  loss {float(loss):.4f}")
    elapsed = time.perf_counter() - start
    ne = wl.normalized_entropy(model, data)
    print(f"held-out NE {ne0:.4f} -> {ne:.4f}; {ns.steps * wl.batch_size / elapsed:,.0f} examples/s")
    engine.close()
    return 0 if ne < ne0 else 1


if __name__ == "__main__":
    sys.exit(main())
