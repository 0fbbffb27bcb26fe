"""MLP proxy: the paper's sanity check, a deep plain MLP classifier cut into runs of blocks.

The paper's first experiment detaches a 30-layer MLP (on MNIST) and measures the backward
time it saves. This is that model at CPU size, on scikit-learn's digits (8×8 images, 10
classes, shipped inside the package, so nothing is downloaded). Without scikit-learn it
falls back to a seeded Gaussian mixture of the same shapes, and ``args["dataset"]`` records
which one a run used.

The whole stack up to the classifier is one chain, ``layers``: ``layers.0`` is the input
projection, ``layers.1`` to ``layers.depth`` the hidden blocks. A cut detaches its input, so
a cut that starts after the input projection leaves it with no gradient from anything; with
the projection inside the chain, the first piece (``layers.0:k``) owns it and trains it with
its local loss, and every piece of the paper's split is a cut. The classifier stays outside
the chain and trains with the main loss, with whatever part of the chain is not cut.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError, shown
from erase_tune.workloads import fused_if_cuda
from erase_tune.workloads.base import Batch, Workload, WorkloadData, builtin_workload, prior_entropy
from erase_tune.workloads.limits import TRAINING_BYTES_PER_PARAMETER, Need, check_arg, check_ints, pool_need

__all__ = [
    "NUM_FEATURES",
    "NUM_CLASSES",
    "DATASETS",
    "InputBlock",
    "MLPBlock",
    "DeepMLP",
    "cut_candidates",
    "fan_in_adam",
    "workload",
]

NUM_FEATURES = 64
NUM_CLASSES = 10
DATASETS = ("digits", "synthetic")
_HELD_OUT = 0.2
"""Share of digits kept for evaluation."""
_REFERENCE_FAN_IN = NUM_FEATURES
"""Fan-in at which a matrix steps at the full ``lr`` (see :func:`fan_in_adam`)."""
_DEFAULT_DATASET = "digits" if importlib.util.find_spec("sklearn") is not None else "synthetic"
# find_spec, not import: importing scikit-learn costs about a second and this module is
# imported whenever any workload is listed.


class InputBlock(nn.Module):
    """Input projection, Linear → ReLU: (B, in_dim) → (B, W). The chain's first block."""

    def __init__(self, *, in_dim: int, width: int) -> None:
        super().__init__()
        # PyTorch's default Linear initialisation, as the projection always had.
        self.linear = nn.Linear(in_dim, width)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.linear(x))


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
    """``forward(x (B, in_dim) float) -> logits (B, classes)``: the chain ``layers`` (input
    projection ``layers.0``, then ``depth`` hidden blocks), then the classifier ``head``.

    Any run ``layers.i:j`` is a cut target, and ``layers.0:j`` is one that leaves no
    parameter upstream of it (see the module docstring).
    """

    def __init__(self, *, in_dim: int, width: int, depth: int, classes: int, layer_norm: bool = True) -> None:
        super().__init__()
        # Built in the order the parameters always were (projection, blocks, classifier), so
        # a seed gives the same weights as before the projection joined the chain.
        blocks = [InputBlock(in_dim=in_dim, width=width)]
        blocks += [MLPBlock(width=width, layer_norm=layer_norm) for _ in range(depth)]
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
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


def _example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """The first training batch of a one-batch pool (for digits, the same images as the
    full pool's first batch), whatever ``train_batches`` is."""
    return _make_data(device, args={**args, "train_batches": 1, "eval_batches": 1}).batch(0)


def fan_in_adam(params: Iterable[nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    """Adam whose step size for a weight matrix of fan-in ``n`` is ``lr * min(1, 64 / n)``
    (biases and norm gains keep ``lr``): µP's rule for Adam, so ``lr`` means the same at
    every width.

    Why: Adam's step is about ``lr`` per entry whatever the gradient's size, and a batch's
    gradient of a layer is nearly low rank, so one step moves a ``width x width`` matrix by
    about ``lr * width`` in spectral norm: 0.15-0.21 after the first step at width 1024 and
    lr 3e-4, against 2.8 for the He-initialised matrix. This plain ReLU stack already maps
    different images onto nearly one direction at init (after the last block, mean cosine
    0.97 between images: the known drift of deep ReLU nets), and those first steps grow
    that direction until it is all there is (from block 20 on, within two steps): every
    image reaches the head as the same vector, the loss sits at ln 10 and NE at 1.0. With
    one step size for all layers, lr 3e-4 trained at widths 256 and 512, and lr 1e-3 did
    not at 256. With the step scaled by ``64 / fan_in`` (the input layer, fan-in 64, keeps
    ``lr``), lr 1e-3 trained at every width tried, 64 to 1024. The aux heads a cut adds are
    matrices of fan-in ``width`` too, and get the same rule.
    """
    groups: dict[float, list[nn.Parameter]] = {}
    for p in params:
        fan_in = math.prod(p.shape[1:]) if p.ndim >= 2 else 0
        scale = min(1.0, _REFERENCE_FAN_IN / fan_in) if fan_in else 1.0
        groups.setdefault(lr * scale, []).append(p)
    # One param group per distinct step size: few groups, so the fused/foreach kernels
    # still update many tensors per launch.
    return fused_if_cuda(torch.optim.Adam, [{"params": ps, "lr": group_lr} for group_lr, ps in groups.items()], lr=lr)


_INTS = ("batch", "width", "depth", "train_batches", "eval_batches", "seed")
"""The integer arguments, checked in this order (bounds: ``limits.INT_BOUNDS`` and :data:`_BOUNDS`)."""
_BOUNDS = {"depth": (1, 1024)}
"""Bounds on this workload's own integer arguments: far above any real run, low enough that no
argument can make the factory hang."""

_BYTES_PER_EXAMPLE = 800
"""Peak host memory per pooled example while building the pools (64 float32 features and
an int64 label are 264 B; the synthetic draw holds about three copies). Measured 1.2x (digits) to
3x (synthetic) the pools' size on a CPU (torch 2.13)."""


def _parameter_count(args: dict[str, Any]) -> int:
    """Parameters of :class:`DeepMLP` for ``args`` (counted, not built: see ``limits``)."""
    w = args["width"]
    block = w * w + w + (2 * w if args["layer_norm"] else 0)
    return (NUM_FEATURES + 1) * w + args["depth"] * block + (w + 1) * NUM_CLASSES


def _needs(args: dict[str, Any]) -> list[Need]:
    """What the model (trained with Adam) and the data pools need, from the arguments alone."""
    params = _parameter_count(args)
    return [
        Need("the model", params * TRAINING_BYTES_PER_PARAMETER, f"depth={args['depth']}, width={args['width']}"),
        pool_need(args, _BYTES_PER_EXAMPLE),
    ]


def cut_candidates(depth: int) -> tuple[str, ...]:
    """Cut candidates of a ``depth``-block stack, in chain order, upstream first.

    First the paper's pieces: the hidden blocks split in thirds (after ``round(depth / 3)``
    and ``round(2 * depth / 3)`` of them), the first third together with the input
    projection ``layers.0``, so ``layers.0:11``, ``layers.11:21``, ``layers.21:31`` for depth 30.
    Detaching the first ``k`` of them leaves no parameter untrained; detaching a later one
    without those before it starves the projection and the blocks upstream of it, which is
    why they come first (a search offers "detach" for a candidate only once the candidates
    before it cover its upstream). Then single hidden blocks every ``max(1, depth // 6)``
    (``layers.1``, ``layers.6``, ..., ``layers.26`` for depth 30), for placement on a side
    stream (a placement detaches nothing, so it starves nothing); a single that is already a
    one-block piece is not repeated.
    """
    bounds = [0, *(1 + round(i * depth / 3) for i in (1, 2)), depth + 1]
    pieces = [f"layers.{a}:{b}" for a, b in zip(bounds, bounds[1:]) if b > a]
    singles = [f"layers.{i}" for i in range(1, depth + 1, max(1, depth // 6)) if f"layers.{i}:{i + 1}" not in pieces]
    return tuple(pieces + singles)


# wide: the workload's user-facing arguments (--arg key=value)
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

    ``lr`` is Adam's step size at fan-in 64; wider matrices step at ``lr * 64 / fan_in``
    (:func:`fan_in_adam`), so one ``lr`` suits every width: 1e-3 took this 30-layer stack
    to held-out NE 0.04-0.13 in 100 steps at width 256 (seeds 0-2) and 0.05 at 1024 (CPU,
    digits, batch 512). One step size for all layers left it at 0.6-1.0 (width 256, lr
    1e-3) and 1.006 (width 1024, lr 3e-4).
    """
    args = dict(locals())
    check_ints("mlp", args, _INTS, _BOUNDS)
    check_arg("mlp", "lr", lr, lr > 0 and math.isfinite(lr), "a finite number > 0")
    if dataset not in DATASETS:
        raise WorkloadError(
            f"workload 'mlp': argument 'dataset' must be one of {', '.join(DATASETS)}, got {shown(dataset)}"
        )
    if dataset == "digits" and importlib.util.find_spec("sklearn") is None:
        raise WorkloadError(
            "workload 'mlp': dataset 'digits' needs scikit-learn, which is not installed (use dataset='synthetic')"
        )
    return builtin_workload("mlp", args, _needs, build_model=_build_model, make_data=_make_data,
                            make_example=_example, loss_fn=F.cross_entropy, cut_candidates=cut_candidates(depth),
                            optimizer=functools.partial(fan_in_adam, lr=lr))
