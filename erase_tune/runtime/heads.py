"""Aux heads: what turns a cut's output into a prediction its local loss can score.

Each cut gets a head, made once from the probe's view of the cut's output and the model's
output: the default :class:`LinearHead`, or the user's ``make_head(cut_name, cut_output,
model_output)``. Every head is seeded from its cut's name (the same init in every engine)
and checked once on the example batch: it must map the cut's output to the model output's
shape and give ``loss_fn`` a finite value; anything else is a one-line :class:`PlanError`
that names the cut and the fix.

A multi-task prediction (a dict ``{task name: tensor}``) gets one head per task
(:class:`TaskHeads`), each checked against its task's output and named in the line. Where a
task's output ends in a sigmoid and its head's does not, the head's values on the example batch
prove nothing about the next step's, so a loss that rejects values outside [0, 1] (BCE) refuses
the head at once instead of failing at a later training step.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from erase_tune._files import aux_weight_problem
from erase_tune.errors import PlanError, first_line, shown
from erase_tune.runtime.pieces import tensors_in
from erase_tune.runtime.plan import Cut
from erase_tune.runtime.losscheck import task_tensors
from erase_tune.runtime.probing import output_activation

__all__ = ["LinearHead", "TaskHeads", "HeadFactory", "build_heads"]

HeadFactory = Callable[[str, Tensor, Tensor], nn.Module]
"""``(cut_name, cut_output, model_output) -> head``."""

_ACTIVATIONS: Mapping[str, Callable[[Tensor], Tensor] | None] = {
    "none": None,
    "sigmoid": torch.sigmoid,
    "softmax": functools.partial(torch.softmax, dim=-1),
    "log_softmax": functools.partial(torch.log_softmax, dim=-1),
}

class LinearHead(nn.Module):
    """Default aux head: a linear map from the cut's output features to the model's output.

    (…, d) → (…, k) where k is the model output's last dim; a 1-D model output (B,) is
    matched by mapping to one feature and squeezing it. ``activation`` repeats the one the
    model's output ends in (``sigmoid``, ``softmax`` or ``log_softmax`` over the last dim),
    so the head produces what ``loss_fn`` takes: probabilities for BCE, logits otherwise.
    """

    def __init__(self, in_features: int, out_features: int, squeeze: bool, activation: str = "none") -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
        self.proj = nn.Linear(in_features, out_features)
        self.squeeze = squeeze
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x)
        if self.squeeze:
            y = y.squeeze(-1)
        act = _ACTIVATIONS[self.activation]
        return act(y) if act is not None else y


class TaskHeads(nn.Module):
    """Default aux head of a multi-task model (a prediction ``{task: tensor}``): one
    :class:`LinearHead` per task, each ending in its task output's activation, so each task's
    loss sees what it takes (probabilities for a click tower's BCE, logits for another's)."""

    def __init__(self, heads: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.names = tuple(heads)
        self.heads = nn.ModuleList(heads.values())

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {name: head(x) for name, head in zip(self.names, self.heads)}


def _default_head(name: str, cut_out: Tensor, model_out: Any, *, activation: Any = "none") -> nn.Module:
    if task_tensors(model_out):
        acts = activation if isinstance(activation, Mapping) else {}
        return TaskHeads({k: _default_head(name, cut_out, v, activation=acts.get(k, "none"))
                          for k, v in model_out.items()})
    if not isinstance(model_out, Tensor):
        raise PlanError(f"cut {shown(name)}: the model returns {type(model_out).__name__}, not one tensor, so the "
                        "default aux head cannot match it: pass output= to pick the prediction out of it "
                        "(or make_head with a head for this output)")
    squeeze = model_out.dim() == cut_out.dim() - 1
    out_features = 1 if squeeze else model_out.shape[-1]
    return LinearHead(cut_out.shape[-1], out_features, squeeze, activation)


def build_heads(cuts: Sequence[Cut], outputs: Mapping[str, Tensor], model_output: Any, activation: Any,
                target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
                make_head: HeadFactory | None) -> dict[str, nn.Module]:
    """One checked head per cut, by cut name (see the module docstring)."""
    factory = make_head or functools.partial(_default_head, activation=activation)
    heads: dict[str, nn.Module] = {}
    for cut in cuts:
        out = outputs[cut.name]
        problem = aux_weight_problem(cut.aux_weight, out.dtype)  # the plan file was checked for float32 only
        if problem:
            raise PlanError(f"cut {shown(cut.name)}: aux_weight {cut.aux_weight:g} {problem} (the cut's output is "
                            f"{str(out.dtype).removeprefix('torch.')})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(cut.name.encode()))  # same head init in every engine
            head = factory(cut.name, out, model_output).to(device=out.device, dtype=out.dtype)
        _check_head(cut.name, head, out, model_output, target, loss_fn, activation)
        heads[cut.name] = head
    return heads


def _check_head(name: str, head: nn.Module, out: Tensor, model_out: Any, target: Tensor,
                loss_fn: Callable[[Tensor, Tensor], Tensor], activation: Any = "none") -> None:
    fix = "pass make_head with a head for this cut"
    try:
        with torch.enable_grad():  # (the head's autograd graph shows the activation it ends in)
            live = head(out.detach())
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise PlanError(f"cut {shown(name)}: the aux head fails on the cut's output "
                        f"({first_line(e)}); {fix}") from None
    with torch.no_grad():
        pred = _detached(live)
        if task_tensors(model_out):
            if not task_tensors(pred) or set(pred) != set(model_out):
                got = sorted(pred) if isinstance(pred, dict) else type(pred).__name__
                raise PlanError(f"cut {shown(name)}: the aux head gives {got}, but the model's prediction is one "
                                f"tensor per task {sorted(model_out)}; {fix} that returns {{task: prediction}}")
            pairs = [(f" task {shown(k)}", pred[k], model_out[k]) for k in model_out]
        else:
            pairs = [("", pred, model_out)]
        for task, p, m in pairs:
            shape = tuple(getattr(m, "shape", ()))
            if not isinstance(p, Tensor) or tuple(p.shape) != shape:
                got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
                raise PlanError(f"cut {shown(name)}:{task} aux head maps output {tuple(out.shape)} to {got}, "
                                f"but the model's output{' for the task' if task else ''} is {shape}; {fix}")
        try:
            loss = _loss_on_cpu(loss_fn, pred, target)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise PlanError(f"cut {shown(name)}: loss_fn does not take the aux head's output "
                            f"({first_line(e)}); {fix} whose output loss_fn takes") from None
        if not isinstance(loss, Tensor) or not bool(torch.isfinite(loss).all()):
            raise PlanError(f"cut {shown(name)}: loss_fn gives {shown(loss)} on the aux head's output for the "
                            f"example batch; {fix} whose output loss_fn takes (or fix the loss, if it is at fault)")
        _check_range(name, live, pred, target, loss_fn, activation, fix)


def _check_range(name: str, live: Any, pred: Any, target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
                 activation: Any, fix: str) -> None:
    """Where the model's output is a sigmoid and the head's is not, the head's values on the example
    batch say nothing of the next step's: refuse if ``loss_fn`` rejects values outside [0, 1] (BCE
    on raw values), so such a plan never reaches training to fail at its first step."""
    if task_tensors(pred):
        acts = activation if isinstance(activation, Mapping) else {}
        slots = [(k, acts.get(k, "none"), live.get(k) if isinstance(live, dict) else None) for k in pred]
    else:
        slots = [(None, activation, live)]
    for key, act, value in slots:
        if act != "sigmoid" or (isinstance(value, Tensor) and output_activation(value) == "sigmoid"):
            continue
        outside = {**pred, key: torch.full_like(pred[key], 2.0)} if key is not None else torch.full_like(pred, 2.0)
        try:
            _loss_on_cpu(loss_fn, outside, target)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            task = f" task {shown(key)}:" if key is not None else ""
            raise PlanError(f"cut {shown(name)}:{task} the aux head's output does not end in a sigmoid like the "
                            f"model's, and loss_fn rejects values outside [0, 1] ({first_line(e)}), which the head "
                            f"can give in training; {fix} that ends in torch.sigmoid") from None


def _on_cpu(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    return x.cpu()


def _detached(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _loss_on_cpu(loss_fn: Callable[[Tensor, Tensor], Tensor], pred: Tensor, target: Tensor) -> Any:
    """``loss_fn(pred, target)``, on CPU copies where the loss allows: a CUDA loss kernel given
    out-of-range input (BCE on logits) fails with a device-side assert that ends the process's
    CUDA context, while on the CPU it is an ordinary error."""
    if all(t.device.type == "cpu" for t in tensors_in(pred)):
        return loss_fn(pred, target)
    try:
        return loss_fn(_on_cpu(pred), target.cpu())
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if "device" not in str(e):
            raise
    return loss_fn(pred, target)  # the loss holds device state of its own (a weight, a module)
