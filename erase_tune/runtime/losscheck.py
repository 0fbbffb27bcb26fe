"""The workload's loss, checked on the model's own output before any timing.

Three loss mistakes mislead rather than fail (issue 17): a loss not reduced to a scalar ends
deep in ``backward()`` ("grad can be implicitly created only for scalar outputs"); a loss that
rejects the model's output was blamed on a cut's aux head (or was a bare traceback without
cuts); and a sum-reduced loss trains, but the NE a study reports is then the sum over the
batch (hundreds, not ~1). :func:`check_loss` runs the model once on an example batch (eval
mode, no grad, the RNG restored) and raises a one-line :class:`PlanError` for each, blaming
the loss. It holds for every plan, with or without cuts: it looks at the model and the loss only.

Inside every training step, :func:`main_loss` is how an engine turns the model's output into
the main loss (``model_loss=`` for a model that computes its own, else ``loss_fn`` on the
prediction ``output=`` picks), and :func:`check_main_loss` is the one line for a main loss
that cannot train anything.
:func:`select_output` picks the prediction (or the loss) out of a structured model output,
and :func:`task_tensors` tells a multi-task prediction (``{task: tensor}``); the probe and the
aux heads use them too.

A mean-reduced loss is detected without knowing the loss: on the batch repeated twice it
gives exactly the same value as on the batch (the mean of a multiset doubled is its mean); a
sum-reduced loss gives twice the value. Outputs or targets that cannot be repeated along
their first dimension (not tensors, or of different lengths) skip that check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from erase_tune.errors import EraseTuneError, PlanError, one_line, shown
from erase_tune.runtime.pieces import tensors_in
from erase_tune.runtime.plan import ErasePlan

__all__ = ["check_loss", "check_loss_value", "main_loss", "check_main_loss", "select_output", "task_tensors"]

_SUM_RATIO = 1.5
"""Loss on the doubled batch over loss on the batch above this: not a mean (a sum gives 2)."""


def check_loss(model: nn.Module, inputs: tuple[Any, ...], target: Tensor,
               loss_fn: Callable[[Tensor, Tensor], Tensor], output: Callable[[Any], Any] | None = None) -> float:
    """Run ``model(*inputs)`` and check ``loss_fn`` on its output (see the module docstring), or on
    ``output(model_output)`` for a model whose forward returns a structure (the prediction a
    workload's ``output`` selector picks); returns the loss value on the example batch."""
    with _quiet(model), torch.no_grad():
        out = model(*inputs)
    return check_loss_value(out if output is None else output(out), target, loss_fn)


def check_loss_value(output: Any, target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> float:
    """The checks of :func:`check_loss` on a model output already computed."""
    with torch.no_grad():
        try:
            loss = loss_fn(output, target)
        except Exception as e:  # noqa: BLE001 - whatever the loss raises, the loss is what failed
            raise PlanError(f"loss_fn rejects the model's own output {_shape(output)} with target {_shape(target)} "
                            f"({type(e).__name__}: {_first_line(e)}): fix the loss (or the model's output); this is "
                            "not about any cut or aux head") from None
        if not isinstance(loss, Tensor):
            raise PlanError(f"loss_fn returns {type(loss).__name__}, not a tensor: it must return the batch's mean "
                            "loss as a scalar tensor")
        if loss.numel() != 1 or loss.dim() > 1:
            raise PlanError(f"loss_fn returns a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it to the "
                            "batch's mean (reduction='mean', or .mean())")
        value = float(loss.float())
        if not torch.isfinite(loss.float()).all():
            raise PlanError(f"loss_fn gives {value} on the model's own output for the example batch, before any "
                            "training: check the loss and the data")
        doubled = _doubled(output, target)
        if doubled is not None and value != 0.0:
            try:
                twice = float(loss_fn(*doubled).float())
            except Exception:  # noqa: BLE001 - a loss tied to the batch size: nothing to compare
                return value
            ratio = twice / value
            if ratio > _SUM_RATIO:
                raise PlanError(f"loss_fn is not a mean over the batch: it gives {value:.4g} on the example batch and "
                                f"{twice:.4g} ({ratio:.2f}x) on the same batch repeated twice, where a mean-reduced "
                                "loss gives the same value (likely cause: reduction='sum'; NE would be "
                                "meaningless): use reduction='mean'")
    return value


def main_loss(out: Any, target: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
              output: Callable[[Any], Tensor] | None, model_loss: Callable[[Any], Tensor] | None) -> Tensor:
    """``model_loss(out)`` if the model computes its own, else ``loss_fn`` on the prediction
    (``output(out)`` if there is a selector)."""
    if model_loss is not None:
        return select_output(model_loss, out, "model_loss")
    if output is None:
        return loss_fn(out, target)
    pred = select_output(output, out)
    if (torch.is_grad_enabled() and not any(p.requires_grad for p in tensors_in(pred))
            and any(t.requires_grad for t in tensors_in(out))):
        raise EraseTuneError("output=: the prediction it picks is detached in the model's output, so no loss on it "
                             "trains the model: pass model_loss= to pick the loss the model computes itself "
                             "(DLRMTrain: lambda out: out[0])")
    return loss_fn(pred, target)


def check_main_loss(main: Tensor, plan: ErasePlan) -> None:
    """A main loss with no gradient: one line, blaming the plan's cuts when it has any."""
    if isinstance(main, Tensor) and main.requires_grad:
        return
    if plan.cuts:
        raise PlanError(f"the main loss has no gradient path under this plan: its cuts "
                        f"({', '.join(shown(c.module) for c in plan.cuts)}) detach every path "
                        "from the model's output to a trainable parameter")
    raise EraseTuneError("the loss does not require grad: no trainable parameter reaches the model's output")


def _doubled(output: Any, target: Tensor) -> tuple[Any, Tensor] | None:
    if task_tensors(output):  # a multi-task prediction: each task's repeated
        twice = [_doubled(v, target) for v in output.values()]
        if any(t is None for t in twice):
            return None
        return {k: t[0] for k, t in zip(output, twice) if t is not None}, torch.cat([target, target])
    if not isinstance(output, Tensor) or not isinstance(target, Tensor) or output.dim() == 0 or target.dim() == 0:
        return None
    if output.shape[0] != target.shape[0]:
        return None
    return torch.cat([output, output]), torch.cat([target, target])


def _shape(x: Any) -> str:
    if task_tensors(x):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in x.items()) + "}"
    if isinstance(x, Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return shown(type(x).__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


@contextlib.contextmanager
def _quiet(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, no BatchNorm statistics moved) and the RNG state restored."""
    modes = {m: m.training for m in model.modules()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def select_output(output: Callable[[Any], Tensor], model_output: Any, label: str = "output") -> Tensor:
    """``output(model_output)``, the prediction (or with ``label="model_loss"``, the loss) in a
    structured model output; a one-line :class:`EraseTuneError` when the selector fails on it
    or returns no tensor."""
    what = type(model_output).__name__
    try:
        pred = output(model_output)
    except (LookupError, AttributeError, TypeError, ValueError) as e:
        text = str(e).strip().splitlines()
        raise EraseTuneError(f"{label}=: fails on the model's output (a {what}): {type(e).__name__}: "
                             f"{one_line(text[0]) if text else ''}".rstrip(": ")) from None
    if label != "model_loss" and task_tensors(pred):
        return pred  # type: ignore[return-value]  # a multi-task prediction {task: tensor}
    if not isinstance(pred, Tensor):
        raise EraseTuneError(f"{label}=: returns {type(pred).__name__} from the model's output (a {what}), "
                             f"but the {'loss' if label == 'model_loss' else 'prediction'} must be one tensor"
                             f"{'' if label == 'model_loss' else ' (or a dict of them, one per task)'}")
    return pred


def task_tensors(pred: Any) -> bool:
    """Whether ``pred`` is a multi-task prediction: a non-empty dict ``{task name: tensor}``."""
    return (isinstance(pred, dict) and bool(pred) and all(isinstance(k, str) for k in pred)
            and all(isinstance(v, Tensor) for v in pred.values()))
