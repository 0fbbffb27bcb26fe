"""What a workload is: a model factory, its loss, optimizer, data and candidate cuts.

A workload is everything erase-tune needs to train a model for a few hundred steps and
judge both its speed and its quality. Built-ins live next to this file (``ctr``, ``gpt``,
``mlp``); a user's own is a function ``package.module:factory(**args) -> Workload``.

Quality is reported for every workload as normalized entropy (NE): the model's mean held-out
loss divided by the cross-entropy of a constant predictor at the training label prior
(base rate for CTR, class/byte frequencies otherwise). Lower is better; 1.0 = no skill.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Batch", "WorkloadData", "Workload", "prior_entropy"]

Batch = tuple[tuple[Tensor, ...], Tensor]
"""One batch: the model's positional inputs and the target the loss compares against."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadData:
    """Batches already on the training device (so data loading never enters a timing)."""

    train: Sequence[Batch]
    """Training pool; step ``i`` trains on ``train[i % len(train)]``."""
    eval: Sequence[Batch]
    """Held-out batches for quality."""
    prior_entropy: float
    """Cross-entropy (nats/label) of the constant predictor at the training label prior."""

    def __post_init__(self) -> None:
        if not self.train or not self.eval:
            raise ValueError("WorkloadData needs at least one train and one eval batch")
        if not (self.prior_entropy > 0 and math.isfinite(self.prior_entropy)):
            raise ValueError(f"prior_entropy must be > 0, got {self.prior_entropy}")

    def batch(self, step: int) -> Batch:
        """The training batch for global step ``step``."""
        return self.train[step % len(self.train)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A trainable proxy: everything a trial needs, nothing about how it is cut."""

    name: str
    """Built-in name or ``package.module:factory``."""
    args: Mapping[str, Any]
    """The resolved arguments (recorded as provenance)."""
    build_model: Callable[[], nn.Module]
    """Returns a fresh model on the CPU in float32, identical on every call (seeded)."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """Mean-reduced loss ``loss_fn(output, target)``; also used for each cut's local loss."""
    make_data: Callable[[torch.device], WorkloadData]
    """Builds the train pool and held-out batches on a device (deterministic)."""
    cut_candidates: tuple[str, ...]
    """Cut targets a search may detach (module names or runs ``blocks.0:2``)."""
    batch_size: int
    """Examples per training step (QPS = batch_size / step time)."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = dataclasses.field(
        default=lambda params: torch.optim.Adam(params, lr=1e-3)
    )
    """Optimizer factory over all trainable parameters (model and aux heads)."""
    make_head: Callable[[str, Tensor, Tensor], nn.Module] | None = None
    """Optional aux-head factory ``(cut_name, cut_output, model_output) -> module``;
    None uses the engine's default linear head."""
    make_example: Callable[[torch.device], Batch] | None = None
    """Optional: one batch on a device with the training batch's shapes and dtypes (and
    values as valid: ids in range, labels in the label set), for probing the model and
    sizing aux heads without building the whole data pool; None falls back to
    ``make_data(device).batch(0)``. See :meth:`example`."""
    output: Callable[[Any], Tensor] | None = None
    """Optional: picks the prediction out of a model output that is a structure (a tuple,
    TorchRec's ``DLRMTrain`` returning ``(loss, (loss, logits, labels))``): ``loss_fn`` and
    the aux heads then see ``output(model(*inputs))``. None: the model's output as it is
    (``EraseEngine``'s ``output=``)."""

    reuse_data: bool = True
    """``make_data`` and ``build_model`` are what their docstrings promise (deterministic, the same
    on every call), so a trial worker keeps their results for the next trial, confirmation and
    noise floor of the same job instead of building them again (a large model's initialisation
    and its data pool are most of a short trial). False builds them anew for every one (a data
    factory with side effects: one that reads a stream, or counts its calls)."""

    model_loss: Callable[[Any], Tensor] | None = None
    """Optional: picks the loss out of the output of a model that computes its own
    (``DLRMTrain``: ``lambda out: out[0]``): the main loss of training; ``loss_fn`` (on
    ``output``'s prediction) then serves the cuts' local losses and held-out NE
    (``EraseEngine``'s ``model_loss=``)."""

    def prediction(self, model_output: Any) -> Any:
        """What ``loss_fn`` takes from one model output: ``output(model_output)``, or itself."""
        return model_output if self.output is None else self.output(model_output)

    def training_loss(self, model_output: Any, target: Tensor) -> Tensor:
        """The main loss of a plain training step on one model output."""
        if self.model_loss is not None:
            return self.model_loss(model_output)
        return self.loss_fn(self.prediction(model_output), target)

    def example(self, device: torch.device) -> Batch:
        """One batch shaped like a training batch, on ``device``: ``make_example(device)``
        when the workload has one, else the first batch of ``make_data(device)``."""
        if self.make_example is not None:
            return self.make_example(device)
        return self.make_data(device).batch(0)

    def normalized_entropy(self, model: nn.Module, data: WorkloadData) -> float:
        """Held-out NE of ``model``: mean eval loss / prior cross-entropy."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for inputs, target in data.eval:
                total += float(self.loss_fn(self.prediction(model(*inputs)), target)) * len(target)
                count += len(target)
        model.train(was_training)
        return total / count / data.prior_entropy


def prior_entropy(labels: Tensor, num_classes: int | None = None) -> float:
    """Cross-entropy (nats) of predicting the empirical label distribution of ``labels``.

    Binary float labels give the base-rate entropy; integer labels give the entropy of the
    class frequencies (``num_classes`` fixes the support).
    """
    if labels.is_floating_point():
        p = float(labels.float().mean())
        p = min(max(p, 1e-7), 1 - 1e-7)
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))
    counts = torch.bincount(labels.flatten().long(), minlength=num_classes or 0).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())
