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
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from erase_tune.workloads.limits import Need, check_memory

__all__ = ["Batch", "WorkloadData", "Workload", "Task", "TaskLossError", "builtin_workload", "prior_entropy"]

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


class TaskLossError(ValueError):
    """One task's loss failed; the message names the task (``task 'click': ...``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One output of a multi-task model, with its own loss, label and NE.

    ``output`` picks the task's prediction out of the model's output (``lambda out: out[0]``),
    ``label`` its labels out of the batch's target: a column index of a (B, tasks) target, or a
    function of the target. The task's loss is ``weight · loss_fn(prediction, labels)``.
    """

    name: str
    output: Callable[[Any], Tensor]
    """Picks this task's prediction out of the model's output."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """Mean-reduced ``loss_fn(prediction, labels)`` of this task (its cuts' local losses too)."""
    label: int | Callable[[Tensor], Tensor]
    """The column of the target that holds this task's labels, or a function picking them."""
    weight: float = 1.0
    """This task's weight in the training loss (and in every cut's local loss)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"Task: name must be a non-empty string, got {self.name!r}")
        for field in ("output", "loss_fn"):
            if not callable(getattr(self, field)):
                raise ValueError(f"task {self.name!r}: {field} must be callable, got {type(getattr(self, field)).__name__}")
        label = self.label
        if not callable(label) and (isinstance(label, bool) or not isinstance(label, int) or label < 0):
            raise ValueError(f"task {self.name!r}: label must be a column index >= 0 or a function of the target, "
                             f"got {label!r}")
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"task {self.name!r}: weight must be a finite number > 0, got {weight!r}")

    def labels(self, target: Tensor) -> Tensor:
        """This task's labels in a batch's target."""
        if callable(self.label):
            return self.label(target)
        if not isinstance(target, Tensor) or target.dim() < 2 or target.shape[-1] <= self.label:
            shape = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
            raise TaskLossError(f"task {self.name!r}: label column {self.label} is not in the target {shape} "
                                "(give each task's labels as a column of a (B, tasks) target)")
        return target[..., self.label]


class _TaskOutputs:
    """``output=`` of a multi-task workload: the model output to ``{task name: prediction}``."""

    def __init__(self, tasks: tuple[Task, ...]) -> None:
        self.tasks = tasks

    def __call__(self, model_output: Any) -> dict[str, Tensor]:
        out = {}
        for task in self.tasks:
            try:
                pred = task.output(model_output)
            except Exception as e:  # noqa: BLE001 - the task's selector failed: say which task
                text = str(e).strip().splitlines()
                raise TaskLossError(f"task {task.name!r}: its output fails on the model's output: "
                                    f"{type(e).__name__}: {text[0][:200] if text else ''}") from None
            if not isinstance(pred, Tensor):
                raise TaskLossError(f"task {task.name!r}: its output returns {type(pred).__name__}, not the "
                                    "task's prediction tensor")
            out[task.name] = pred
        return out


class _TaskLoss:
    """``loss_fn`` of a multi-task workload: ``Σ weight · task.loss_fn(pred[task], labels)``, on a
    prediction ``{task name: tensor}`` (the model's, or an aux head's); a task's failure names it."""

    def __init__(self, tasks: tuple[Task, ...]) -> None:
        self.tasks = tasks

    def task_loss(self, task: Task, prediction: Any, target: Tensor) -> Tensor:
        """One task's (unweighted) loss on its prediction."""
        if not isinstance(prediction, Mapping) or task.name not in prediction:
            got = sorted(prediction) if isinstance(prediction, Mapping) else type(prediction).__name__
            raise TaskLossError(f"task {task.name!r}: no prediction for it (got {got}); a multi-task prediction is "
                                "{task name: tensor}")
        try:
            return task.loss_fn(prediction[task.name], task.labels(target))
        except TaskLossError:
            raise
        except Exception as e:  # noqa: BLE001 - the task's loss failed: say which task
            text = str(e).strip().splitlines()
            raise TaskLossError(f"task {task.name!r}: {type(e).__name__}: {text[0][:200] if text else ''}") from e

    def __call__(self, prediction: Any, target: Tensor) -> Tensor:
        total: Any = None
        for task in self.tasks:
            loss = self.task_loss(task, prediction, target)
            term = loss if task.weight == 1 else task.weight * loss
            total = term if total is None else total + term
        return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A trainable proxy: everything a trial needs, nothing about how it is cut."""

    name: str
    """Built-in name or ``package.module:factory``."""
    args: Mapping[str, Any]
    """The resolved arguments (recorded as provenance)."""
    build_model: Callable[[], nn.Module]
    """Returns a fresh model on the CPU in float32, identical on every call (seeded)."""
    loss_fn: Callable[[Tensor, Tensor], Tensor] = None  # type: ignore[assignment]  # required unless tasks=
    """Mean-reduced loss ``loss_fn(output, target)``; also used for each cut's local loss. A
    multi-task workload (``tasks=``) leaves it out: it is then the weighted sum of the tasks' losses."""
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

    tasks: tuple[Task, ...] = ()
    """A multi-task model's tasks (see :class:`Task`), in place of ``loss_fn`` and ``output``: the
    prediction is then ``{task name: task.output(model_output)}``, the training loss and every cut's
    local loss the weighted sum of the tasks' losses on it (each on its own label column), a cut's
    default aux head one linear head per task, and NE is reported per task
    (:meth:`normalized_entropies`), :meth:`normalized_entropy` being the main task's."""
    main_task: str | None = None
    """The task whose NE gap a study judges (:meth:`normalized_entropy`); None: the first task."""

    def __post_init__(self) -> None:
        tasks = self.tasks
        if not tasks:
            if self.main_task is not None:
                raise ValueError(f"main_task={self.main_task!r} needs tasks=")
            if self.loss_fn is None:
                raise ValueError("Workload needs loss_fn= (or tasks=, one loss per task)")
            return
        if not isinstance(tasks, tuple) or not all(isinstance(t, Task) for t in tasks):
            raise ValueError("tasks= must be a tuple of Task")
        names = [t.name for t in tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tasks=: task names must be unique, {', '.join(map(repr, twice))} appears twice")
        if self.main_task is not None and self.main_task not in names:
            raise ValueError(f"main_task={self.main_task!r} is not a task ({', '.join(map(repr, names))})")
        derived = isinstance(self.loss_fn, _TaskLoss) and self.loss_fn.tasks == tasks
        if self.loss_fn is not None and not derived:
            raise ValueError("tasks= replaces loss_fn=: each task has its own loss_fn; pass one or the other")
        if self.output is not None and not (isinstance(self.output, _TaskOutputs) and self.output.tasks == tasks):
            raise ValueError("tasks= replaces output=: each task picks its own prediction (Task.output)")
        if self.model_loss is not None:
            raise ValueError("tasks= and model_loss= do not go together: with tasks the training loss is the "
                             "weighted sum of the tasks' losses")
        object.__setattr__(self, "loss_fn", _TaskLoss(tasks))
        object.__setattr__(self, "output", _TaskOutputs(tasks))

    @property
    def main(self) -> Task | None:
        """The main task (None for a single-task workload)."""
        if not self.tasks:
            return None
        return next(t for t in self.tasks if t.name == (self.main_task or self.tasks[0].name))

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
        """Held-out NE of ``model``: mean eval loss / prior cross-entropy (a multi-task
        workload's: its main task's, see :meth:`normalized_entropies`)."""
        if self.tasks:
            main = self.main
            assert main is not None
            return self.normalized_entropies(model, data)[main.name]
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for inputs, target in data.eval:
                total += float(self.loss_fn(self.prediction(model(*inputs)), target)) * len(target)
                count += len(target)
        model.train(was_training)
        return total / count / data.prior_entropy

    def normalized_entropies(self, model: nn.Module, data: WorkloadData) -> dict[str, float]:
        """Held-out NE of each task, by task name: the task's mean eval loss over the prior
        cross-entropy of its own labels in the training pool (a single-task workload: its NE
        under its name)."""
        if not self.tasks:
            return {self.name: self.normalized_entropy(model, data)}
        loss = self.loss_fn
        assert isinstance(loss, _TaskLoss)
        was_training = model.training
        model.eval()
        totals = dict.fromkeys((t.name for t in self.tasks), 0.0)
        count = 0
        with torch.no_grad():
            for inputs, target in data.eval:
                pred = self.prediction(model(*inputs))
                for task in self.tasks:
                    totals[task.name] += float(loss.task_loss(task, pred, target)) * len(target)
                count += len(target)
        model.train(was_training)
        return {t.name: totals[t.name] / count / self.task_prior(t, data) for t in self.tasks}

    def task_prior(self, task: Task, data: WorkloadData) -> float:
        """Cross-entropy (nats) of predicting ``task``'s training label prior (its own column)."""
        labels = torch.cat([task.labels(target).flatten() for _, target in data.train])
        return prior_entropy(labels)


def builtin_workload(name: str, args: dict[str, Any], needs: Callable[[dict[str, Any]], Iterable[Need]], *,
                     build_model: Callable[..., nn.Module], make_data: Callable[..., WorkloadData],
                     make_example: Callable[..., Batch], **fields: Any) -> Workload:
    """A built-in's :class:`Workload` from its checked arguments ``args``, once the memory they need
    (``needs(args)``) is found to fit (:func:`~erase_tune.workloads.limits.check_memory`): the
    arguments recorded (a copy), ``build_model``, ``make_data`` and ``make_example`` bound to them
    (keyword ``args``), the batch size ``args["batch"]``; ``fields`` are the rest (loss, cut
    candidates, optimizer, ...)."""
    check_memory(name, needs(args))
    return Workload(name=name, args=dict(args), build_model=functools.partial(build_model, args=args),
                    make_data=functools.partial(make_data, args=args), batch_size=args["batch"],
                    make_example=functools.partial(make_example, args=args), **fields)


def split_pools(batches: Callable[..., list[Batch]], tensors: Sequence[Tensor], train: slice, held: slice,
                batch: int) -> WorkloadData:
    """The train and eval pools of ``tensors`` (the labels last): the rows ``train`` and
    ``held`` pick, each cut by ``batches(*tensors, batch)``; the prior entropy is that of the
    train labels. The synthetic and the file-backed data of a workload are split alike."""
    return WorkloadData(
        train=batches(*(t[train] for t in tensors), batch),
        eval=batches(*(t[held] for t in tensors), batch),
        prior_entropy=prior_entropy(tensors[-1][train]),
    )


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
