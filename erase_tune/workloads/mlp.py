"""MLP proxy: the paper's sanity check, a deep plain MLP classifier cut into runs of blocks.

The paper's first experiment detaches a 30-layer MLP (on MNIST) and measures the backward
time it saves. This is that model at CPU size, on scikit-learn's digits (8×8 images, 10
classes, shipped inside the package, so nothing is downloaded). Without scikit-learn it
falls back to a seeded Gaussian mixture of the same shapes, and ``args["dataset"]`` records
which one a run used.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError
from erase_tune.workloads import fused_if_cuda
from erase_tune.workloads.base import Batch, Workload, WorkloadData, prior_entropy

__all__ = ["NUM_FEATURES", "NUM_CLASSES", "DATASETS", "MLPBlock", "DeepMLP", "workload"]

NUM_FEATURES = 64
NUM_CLASSES = 10
DATASETS = ("digits", "synthetic")
_HELD_OUT = 0.2
"""Share of digits kept for evaluation."""
_DEFAULT_DATASET = "digits" if importlib.util.find_spec("sklearn") is not None else "synthetic"
# find_spec, not import: importing scikit-learn costs about a second and this module is
# imported whenever any workload is listed.


class MLPBlock(nn.Module):
    """Linear → (LayerNorm) → ReLU: (B, W) → (B, W)."""

    def __init__(self, *, width: int, layer_norm: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width) if layer_norm else nn.Identity()
        # He initialisation keeps the activation scale through 30 ReLU layers without norms.
        nn.init.kaiming_normal_(self.linear.weight, nonlinearity="relu")
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm(self.linear(x)))


class DeepMLP(nn.Module):
    """``forward(x (B, in_dim) float) -> logits (B, classes)``: input projection, ``depth``
    blocks in ``layers`` (a chain, so any run ``layers.i:j`` is a cut target), classifier."""

    def __init__(self, *, in_dim: int, width: int, depth: int, classes: int, layer_norm: bool = True) -> None:
        super().__init__()
        self.input = nn.Sequential(nn.Linear(in_dim, width), nn.ReLU())
        self.layers = nn.ModuleList(MLPBlock(width=width, layer_norm=layer_norm) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.input(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def _digits(gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = torch.as_tensor(raw.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=gen)
    n_eval = round(len(y) * _HELD_OUT)
    train, held = order[n_eval:], order[:n_eval]
    # Standardise with training statistics only; the floor keeps pixels that are (almost)
    # always blank from turning into huge values on held-out images.
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(0.1)
    x = (x - mean) / std
    return x[train], y[train], x[held], y[held]


def _gaussian_mixture(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` points of a 10-class mixture in 64 dimensions; the class means are drawn first
    from ``gen``, so they are the same for the train and held-out draws of one generator."""
    means = 0.35 * torch.randn(NUM_CLASSES, NUM_FEATURES, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    x = means[y] + torch.randn(n, NUM_FEATURES, generator=gen)
    return x, y


def _make_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    batch, n_train = args["batch"], args["train_batches"] * args["batch"]
    gen = torch.Generator().manual_seed(args["seed"])
    if args["dataset"] == "digits":
        x_train, y_train, x_held, y_held = _digits(gen)
        # The pool cycles through reshuffled epochs of the 1437 training images; the
        # held-out images are used once each, in at most eval_batches batches.
        epochs = math.ceil(n_train / len(y_train))
        picks = torch.cat([torch.randperm(len(y_train), generator=gen) for _ in range(epochs)])[:n_train]
        x_train, y_train = x_train[picks], y_train[picks]
        x_held, y_held = x_held[: args["eval_batches"] * batch], y_held[: args["eval_batches"] * batch]
    else:
        x, y = _gaussian_mixture(n_train + args["eval_batches"] * batch, gen)
        x_train, y_train, x_held, y_held = x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    def batches(x: Tensor, y: Tensor) -> list[Batch]:
        return [((xb.to(device),), yb.to(device)) for xb, yb in zip(x.split(batch), y.split(batch))]

    return WorkloadData(
        train=batches(x_train, y_train),
        eval=batches(x_held, y_held),
        prior_entropy=prior_entropy(y_train, num_classes=NUM_CLASSES),
    )


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def _build_model(*, args: dict[str, Any]) -> DeepMLP:
    # fork_rng: seed the initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        return DeepMLP(
            in_dim=NUM_FEATURES,
            width=args["width"],
            depth=args["depth"],
            classes=NUM_CLASSES,
            layer_norm=args["layer_norm"],
        )


def cut_candidates(depth: int) -> tuple[str, ...]:
    """Thirds of the stack as runs (``layers.0:10`` ... for depth 30), then single blocks
    every ``depth // 6`` layers."""
    thirds = [round(i * depth / 3) for i in range(4)]
    runs = [f"layers.{a}:{b}" for a, b in zip(thirds, thirds[1:]) if b > a]
    singles = [f"layers.{i}" for i in range(0, depth, max(1, depth // 6))]
    return tuple(dict.fromkeys(runs + singles))


def workload(
    *,
    batch: int = 128,
    width: int = 64,
    depth: int = 30,
    layer_norm: bool = True,
    train_batches: int = 8,
    eval_batches: int = 4,
    lr: float = 1e-3,
    dataset: str = _DEFAULT_DATASET,
    seed: int = 0,
) -> Workload:
    """The deep-MLP proxy. ``dataset`` is ``"digits"`` (default when scikit-learn is
    installed) or ``"synthetic"``.

    ``lr=1e-3`` suits widths up to ~128. Wider stacks need less: at width 256 and 512 this
    30-layer plain MLP collapsed to chance with 1e-3 and trained well with 3e-4 (CPU, digits).
    """
    args = dict(locals())
    for name in ("batch", "width", "depth", "train_batches", "eval_batches"):
        if args[name] < 1:
            raise WorkloadError(f"workload 'mlp': argument {name!r} must be an integer >= 1, got {args[name]!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise WorkloadError(f"workload 'mlp': argument 'lr' must be a finite number > 0, got {lr!r}")
    if dataset not in DATASETS:
        raise WorkloadError(f"workload 'mlp': argument 'dataset' must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if dataset == "digits" and importlib.util.find_spec("sklearn") is None:
        raise WorkloadError(
            "workload 'mlp': dataset 'digits' needs scikit-learn, which is not installed (use dataset='synthetic')"
        )
    return Workload(
        name="mlp",
        args=dict(args),
        build_model=functools.partial(_build_model, args=args),
        loss_fn=F.cross_entropy,
        make_data=functools.partial(_make_data, args=args),
        cut_candidates=cut_candidates(depth),
        batch_size=batch,
        optimizer=functools.partial(fused_if_cuda, torch.optim.Adam, lr=lr),
    )
