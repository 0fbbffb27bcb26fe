"""Attaching a plan to a model, once, before an engine's first step; and detaching it.

What :class:`~erase_tune.runtime.engine.EraseEngine` does at construction, in this order:

- :func:`refuse_unfit`: a model the engine cannot train under the plan is a one-line error
  before anything runs (a ``DistributedDataParallel`` wrapper; DDP nested inside the model
  under a plan with targets; TorchRec-sharded tables under a process group), then the plan's
  names are checked against the model.
- :func:`fit_plan`: one probe forward on the example batch (:mod:`erase_tune.runtime.probing`)
  checks that the plan fits the model and sizes the cuts' aux heads
  (:mod:`erase_tune.runtime.heads`); it also returns the check the first step makes.
- :class:`Patches`: each element's first module gets its runner
  (:mod:`erase_tune.runtime.pieces`) as an instance-level ``forward``; later blocks of a run
  become identities. :meth:`Patches.restore` gives every module back the forward it had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from erase_tune.errors import EraseTuneError, PlanError
from erase_tune.runtime import device as dev
from erase_tune.runtime.heads import HeadFactory, build_heads
from erase_tune.runtime.pieces import CutRunner, GraphedRunner, Host, Passthrough, PlacedRunner
from erase_tune.runtime.plan import ErasePlan, Placement
from erase_tune.runtime.probing import FirstStepCheck, probe
from erase_tune.runtime.reduce import refuse_nested_ddp, refuse_sharded

__all__ = ["refuse_unfit", "fit_plan", "Patches", "as_tuple"]


def as_tuple(inputs: Any) -> tuple:
    """A batch's inputs as the positional arguments of the model's forward."""
    if isinstance(inputs, Tensor):
        return (inputs,)
    return tuple(inputs)


def refuse_unfit(model: nn.Module, plan: ErasePlan, process_group: Any) -> None:
    """One line for a model the engine cannot train under ``plan``, before anything runs."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise EraseTuneError(
            "EraseEngine takes the bare module, not DistributedDataParallel: pass model.module and "
            "process_group=...; the engine averages gradients itself (DDP's reducer does not expect the "
            "early backward passes of detached pieces)"
        )
    if process_group is not None:
        refuse_nested_ddp(model)
        refuse_sharded(model)
    plan.check_model(model)


def fit_plan(model: nn.Module, plan: ErasePlan, example: tuple[Any, Tensor] | None,
             loss_fn: Callable[[Tensor, Tensor], Tensor], make_head: HeadFactory | None,
             output: Callable[[Any], Tensor] | None, model_loss: Callable[[Any], Tensor] | None,
             ) -> tuple[dict[str, nn.Module], FirstStepCheck | None]:
    """Probe ``plan`` on the example batch: the cuts' aux heads, and the first step's check
    (none for a plan with no targets: it trains exactly like a plain loop)."""
    if not plan.targets:
        return {}, None
    if example is None:
        raise PlanError("EraseEngine needs example=(inputs, target) to check a plan with cuts, placements or "
                        "graphed pieces against the model and size its aux heads")
    inputs, target = example
    targets = [t.module for t in plan.targets]
    result = probe(model, as_tuple(inputs), targets, output=output, model_loss=model_loss)
    result.check_plan(plan)
    heads = build_heads(plan.cuts, result.outputs, result.model_output, result.output_activation, target,
                        loss_fn, make_head)
    # Kept for the first step's check; the example's tensors are not needed any more.
    return heads, FirstStepCheck(dataclasses.replace(result, model_output=None, outputs={}), model)


class Patches:
    """The runners an engine patched into its model, and the forwards they shadow."""

    def __init__(self) -> None:
        self.saved: list[tuple[nn.Module, Any]] = []
        """(module, the instance forward it had, if any), in patching order."""

    def patch_plan(self, host: Host, model: nn.Module, plan: ErasePlan,
                   heads: Mapping[str, nn.Module]) -> list[CutRunner]:
        """Patch each element's first module with its runner; the cuts' runners, in plan order.
        Under a whole-step graph a graphed piece is already inside the step's graph: on a side
        stream it is a placement."""
        whole = plan.whole_step_graph and host.cuda
        modules = dict(model.named_modules())
        cut_runners = []
        for i, cut in enumerate(plan.cuts):
            graphed = cut.graph and dev.graphs_supported(host.device) and not plan.whole_step_graph
            runner = CutRunner(host, i, cut, [modules[m] for m in cut.members], heads[cut.name], graphed)
            cut_runners.append(runner)
            self.patch(runner)
        for placement in plan.placements:
            self.patch(PlacedRunner(host, placement, [modules[m] for m in placement.members]))
        for g in plan.graphs:
            members = [modules[m] for m in g.members]
            if not whole:
                self.patch(GraphedRunner(host, g, members))
            elif g.stream:
                self.patch(PlacedRunner(host, Placement(module=g.module, stream=g.stream), members))
        return cut_runners

    def patch(self, runner: Any) -> None:
        first, *rest = runner.modules
        for m, fwd in ((first, runner), *((m, Passthrough(m)) for m in rest)):
            self.saved.append((m, m.__dict__.get("forward")))
            m.forward = fwd  # instance attribute shadows the class's forward

    def restore(self) -> None:
        """Give every patched module back its own forward (last patched first)."""
        for m, own in reversed(self.saved):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self.saved = []
