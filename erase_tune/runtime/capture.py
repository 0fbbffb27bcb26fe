"""The whole step as one CUDA graph: eager warm-up, one capture, then replays.

A plan with ``whole_step_graph`` has its whole step (forward, early backwards on their
streams, main backward, optimizer with ``capturable=True``) captured after
``graph_warmup`` eager steps and replayed from then on; launch order is then fixed at
capture, so cuts launch their backward blocking (or deferred) there. Inputs and target are
copied into the graph's static tensors before each replay; a batch of another shape is a
one-line :class:`~erase_tune.errors.CaptureError`. Under a process group the graph holds
forward and backward only: the gradient averaging and the optimizer run eagerly after each
replay, so no collective is ever captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from erase_tune.errors import CaptureError, one_line
from erase_tune.runtime import device as dev
from erase_tune.runtime.pieces import tensors_in
from erase_tune.runtime.plan import ErasePlan

__all__ = ["GraphHost", "StepGraph", "step_graph", "capture_dispatch"]


class GraphHost(Protocol):
    """What a whole-step graph uses of its engine (:class:`~erase_tune.runtime.engine.EraseEngine`)."""

    plan: ErasePlan
    device: torch.device
    cuda: bool
    process_group: Any
    optimizer: torch.optim.Optimizer
    graph_warmup: int
    capture_stream: Any
    graph_owned: set[int]
    capture_retries: int

    def parameters(self) -> Iterator[nn.Parameter]: ...
    def eager_step(self, inputs: tuple, target: Tensor, dispatch: str | None = None) -> Tensor: ...
    def captured_step(self, inputs: tuple, target: Tensor) -> Tensor: ...
    def reduce_after_replay(self) -> None: ...
    def abandon_step(self) -> None: ...


def step_graph(engine: GraphHost) -> StepGraph | None:
    """The engine's whole-step graph when its plan asks for one on CUDA, else None. The
    optimizer is made ``capturable`` so that its step is captured too, unless a process group
    averages the gradients first: then the optimizer runs eagerly after each replay."""
    if not (engine.plan.whole_step_graph and engine.cuda):
        return None
    if engine.process_group is None:
        for group in engine.optimizer.param_groups:
            if "capturable" in group:
                group["capturable"] = True
    return StepGraph(engine)


def capture_dispatch(dispatch: str) -> str:
    """How cuts launch their backward in the steps a whole-step graph records (and its warm-up):
    launch order is fixed at capture, so blocking, or deferred for the detach-only twin."""
    return "deferred" if dispatch == "deferred" else "blocking"


class StepGraph:
    """One engine's whole-step CUDA graph (CUDA only)."""

    def __init__(self, engine: GraphHost) -> None:
        self.engine = engine
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[list[Tensor], Tensor, Tensor] | None = None
        """(input tensors, target, loss) the graph reads and writes."""
        self.steps = 0

    def step(self, inputs: tuple, target: Tensor) -> Tensor:
        eng = self.engine
        if self.graph is None:
            if self.steps < eng.graph_warmup:  # eager warm-up on the capture stream, as capture requires
                main, cap = dev.current_stream(eng.device), eng.capture_stream
                dev.wait_stream(cap, main)
                with dev.use_stream(cap):
                    loss = eng.eager_step(inputs, target, capture_dispatch(eng.plan.dispatch))
                dev.wait_stream(main, cap)
                self.steps += 1
                return loss
            self._capture(inputs, target)
        static_in, static_target, static_loss = self.static  # type: ignore[misc]
        live = tensors_in(inputs)
        if len(live) != len(static_in) or any(s.shape != x.shape or s.dtype != x.dtype for s, x in zip(static_in, live)):
            raise CaptureError(
                "whole-step CUDA graph was captured for inputs "
                f"{[tuple(s.shape) for s in static_in]}, got {[tuple(x.shape) for x in live]}; it needs static shapes"
            )
        for s, x in zip(static_in, live):
            s.copy_(x)
        static_target.copy_(target)
        self.graph.replay()  # type: ignore[union-attr]
        eng.reduce_after_replay()
        self.steps += 1
        return static_loss

    def _capture(self, inputs: tuple, target: Tensor) -> None:
        eng = self.engine
        main, cap = dev.current_stream(eng.device), eng.capture_stream
        static_inputs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, inputs)
        static_target = target.clone()
        # One retry: a capture can be invalidated by unrelated work elsewhere in the process
        # (seen once on an H200 with the GPT proxy); a second failure is the workload's own.
        for attempt in (1, 2):
            for p in eng.parameters():
                p.grad = None  # grads come from the graph's pool: every replay overwrites them
            graph = torch.cuda.CUDAGraph()
            dev.wait_stream(cap, main)
            try:
                with torch.cuda.graph(graph, stream=cap):
                    loss = eng.captured_step(static_inputs, static_target)
                break
            except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
                eng.abandon_step()
                if attempt == 2:
                    raise CaptureError(
                        f"whole-step CUDA graph capture failed ({one_line(str(e).splitlines()[0])}); the step must "
                        "have static shapes and no CPU syncs (.item(), .cpu(), data-dependent control flow)"
                    ) from e
                eng.capture_retries += 1
                dev.synchronize(eng.device)
        dev.wait_stream(main, cap)
        eng.graph_owned.update(id(p) for p in eng.parameters())
        self.graph = graph
        self.static = (tensors_in(static_inputs), static_target, loss)

