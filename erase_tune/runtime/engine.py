"""The ERASE engine: applies an :class:`ErasePlan` to any ``nn.Module`` and trains it.

Per cut, the engine (without editing the model's code) detaches the piece's input and
output, attaches an aux head, and computes the local loss ``λ·ℓ(head(out), y)`` right after
the piece's forward, on the piece's stream. Its backward is then launched at once — from the
main thread (``blocking``) or a worker thread (``threaded``) — so it overlaps the forward
work that follows on the main stream; or, for ``deferred``, it joins the main loss in one
backward at the end (the "detach only" twin). A placement runs its piece's forward on a side
stream as it is (no detach, no head), so its forward overlaps other work and autograd runs
its backward on the same stream. A graphed piece is captured (forward and backward) as CUDA
graphs after a few eager calls and replayed from then on, not detached. Outputs of
side-stream work are joined lazily, where they are first used
(:mod:`erase_tune.runtime.join`), so sibling pieces run side by side. After the main backward
every side stream is joined back to the current stream before the optimizer runs. The
runners that do each element's work live in :mod:`erase_tune.runtime.pieces`; the engine's
own host work per step is a fixed amount, whatever the number of torch calls in the model.

Exactness: gradients inside each cut and inside the remainder equal those of the reference
objective ``L_main + Σ λ_i ℓ_i`` with stop-gradients at the cut boundaries; placements change
no gradient.

Before training, one probe forward (:mod:`erase_tune.runtime.probing`) checks that the plan
fits the model — every target is called, runs are chains, cuts return one tensor and leave
the main loss a gradient path and every parameter a gradient — and sizes the aux heads. A
plan with no cuts and no placements skips it: it trains exactly like a plain loop.

CUDA graphs: a cut flagged ``graph`` has its forward + local loss + backward captured as its
own graph (own memory pool) after a few eager warm-up calls; a plan with
``whole_step_graph`` captures the whole step (forward, early backwards on their streams, main
backward, optimizer with ``capturable=True``) and replays it
(:mod:`erase_tune.runtime.capture`). Graph-owned gradients are overwritten on every replay,
so the engine never sets them to ``None``.

Data parallel: with ``process_group=``, gradients are averaged across the group once per step
(:mod:`erase_tune.runtime.reduce`): per cut right after its local backward, in plan order, or
all at the end, as the plan's ``find_unused_parameters`` says; under a whole-step graph, after
the replay, with the optimizer run eagerly. docs/design.md, "Data parallel".

How a piece is applied (:mod:`erase_tune.runtime.attach`, with the refusals and the probe
made at construction): the first module of a cut, placement or graphed piece gets an
instance-level ``forward`` that runs the whole piece (for a run ``blocks.2:5``: blocks 2, 3,
4 chained); later blocks of a run become identities while the engine is attached.
``close()`` restores the model.

This module is the public engine: its construction, the step, and what the runners and the
step graph call back. The state of a step in progress is one
:class:`~erase_tune.runtime.pieces.StepState` (``engine.state``), handed to the runners.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import device as dev
from erase_tune.runtime.attach import Patches, as_tuple, fit_plan, refuse_unfit
from erase_tune.runtime.capture import StepGraph, capture_dispatch, step_graph
from erase_tune.runtime.heads import HeadFactory, LinearHead
from erase_tune.runtime.join import LazyJoin
from erase_tune.runtime.losscheck import check_main_loss, main_loss
from erase_tune.runtime.pieces import CutRunner, Launcher, StepState
from erase_tune.runtime.plan import ErasePlan
from erase_tune.runtime.probing import FirstStepCheck
from erase_tune.runtime.reduce import GradReducer, data_parallel, early_reducer

_NOTHING = contextlib.nullcontext()  # (reusable: no context to enter without a join)

__all__ = ["EraseEngine", "LinearHead"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_NAMES_SHOWN = 5


class EraseEngine:
    """Train ``model`` under ``plan``: ``engine.step(inputs, target) -> loss``.

    Args:
        model: any ``nn.Module``, already on its device; its code is not edited.
        plan: where to cut and place, and how to run; checked against ``model`` (names, then
            one probe forward: see :mod:`erase_tune.runtime.probing`). A plan that does not fit
            raises a one-line :class:`PlanError`.
        loss_fn: mean-reduced ``loss_fn(output, target)``, for the main and every local loss.
        optimizer: factory over ``engine.parameters()`` (model and aux heads); Adam by default.
            Parameters with sparse gradients (``nn.Embedding(sparse=True)``) need an optimizer
            that takes them (SGD, Adagrad, SparseAdam); a dense-only one is refused at the
            first step with an error naming those parameters.
        example: ``(inputs, target)`` of one batch, used once to probe the plan and size the
            aux heads (needed when the plan has cuts or placements).
        make_head: optional ``(cut_name, cut_output, model_output) -> nn.Module``, the aux head
            of a cut. Its output must have the model output's shape and be what ``loss_fn``
            takes. The default is a :class:`LinearHead` that ends in the activation the model's
            output ends in (sigmoid, softmax or log-softmax over the last dim; none for logits).
            For anything else (a loss over a structured output, a model that ends in tanh, a
            head that needs more than one layer) pass ``make_head``; the engine checks once,
            on the example batch, that ``loss_fn(head(cut_output), target)`` is finite.
        graph_warmup: eager steps (or per-cut calls) before a CUDA graph is captured.
        process_group: data-parallel training: gradients (model and aux heads) are averaged
            across this ``torch.distributed`` group, once per step, on the schedule the plan's
            ``find_unused_parameters`` selects (docs/design.md, "Data parallel"). At
            construction the model's parameters and buffers (and the heads') are broadcast
            from the group's rank 0, as DDP does; every rank must build its engine with the
            same model, plan and example shapes, and feed batches of equal size (the average
            of per-rank mean losses is then the mean over the global batch). ``None`` (the
            default) reduces nothing, even when ``torch.distributed`` is initialised: the
            engine stays single-process. Pass the bare module, never a
            ``DistributedDataParallel`` wrapper (refused, and so is DDP nested inside the model,
            as ``DistributedModelParallel`` adds by default, under a plan with cuts, placements
            or graphed pieces). Sparse gradients are refused, and so are tables sharded by
            TorchRec's ``DistributedModelParallel`` (they differ from rank to rank).
        output: optional ``output(model_output) -> prediction`` for a model whose forward
            returns a structure (a tuple, a dict, TorchRec's ``DLRMTrain`` returning
            ``(loss, (loss, logits, labels))``): the main loss is then
            ``loss_fn(output(model_output), target)``, and the probe and the default aux
            heads see the prediction alone. ``None`` (the default) hands ``loss_fn`` the
            model's output as it is. A multi-task model's prediction may be a dict
            ``{task name: tensor}`` (a workload's ``tasks=`` makes one): ``loss_fn`` takes the
            dict, and a cut's default aux head is one :class:`LinearHead` per task, each ending in
            its task output's activation (:class:`~erase_tune.runtime.heads.TaskHeads`).
        model_loss: optional ``model_loss(model_output) -> loss`` for a model that computes
            its own loss (``DLRMTrain``: ``lambda out: out[0]``; its logits in ``out[1]`` are
            detached): that is the main loss, and ``loss_fn`` serves the cuts' local losses
            alone (give it the loss the model uses, on ``output=``'s prediction).
    """

    # -- what it trains, and how (set at construction, read-only after) -----------------------------
    model: nn.Module
    plan: ErasePlan
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    output: Callable[[Any], Tensor] | None
    model_loss: Callable[[Any], Tensor] | None
    optimizer: torch.optim.Optimizer
    heads: Mapping[str, nn.Module]
    """Aux head of each cut, by cut name."""
    graph_warmup: int
    process_group: Any
    _head_modules: nn.ModuleList
    _params: list[nn.Parameter]
    """Model and head parameters, each once: what ``zero_grad`` clears."""

    # -- where it runs ----------------------------------------------------------------------------
    device: torch.device
    cuda: bool
    capture_stream: Any
    """The stream CUDA graphs are captured on (None on the CPU)."""
    graph_owned: set[int]
    """ids of parameters whose gradients live in a CUDA graph's pool (never set to None)."""
    _streams: list[Any]
    """The plan's side streams (stream ``i`` of the plan is ``_streams[i - 1]``)."""
    _stream_done: dict[int, Any]
    """An event per side stream a target uses (by plan index), recorded at every step's end for the main stream
    to wait on; not unused ones: a stream never forked from a whole-step capture breaks it when waited on."""

    # -- the plan at work: runners patched into the model, and their helpers ----------------------
    _patches: Patches
    _cut_runners: list[CutRunner]
    """The cuts' runners, in plan order (the reducer and the per-cut captures read them)."""
    _launcher: Launcher
    """Launches cuts' early backwards (the worker thread of ``threaded`` dispatch)."""
    _join: LazyJoin | None
    """Joins side-stream outputs where first read (None: no side work, or on the CPU)."""
    _graph: StepGraph | None
    """The whole-step CUDA graph (None: eager steps)."""
    _reducer: GradReducer | None
    """Averages gradients across ``process_group`` (None: single process)."""
    _first_step: FirstStepCheck | None
    """The check after the first backward that every trained parameter was reached."""

    # -- the step in progress, and the steps so far -------------------------------------------------
    state: StepState | None
    """The forward in progress (None between steps): what the runners accumulate."""
    capture_retries: int
    """Whole-step captures that failed once and succeeded on the retry."""
    _steps: int
    """Eager steps completed (the first-step check runs in the first)."""

    # wide: the runtime's public keyword API (a workload's loss, optimizer, heads, output), called so everywhere
    def __init__(
        self,
        model: nn.Module,
        plan: ErasePlan,
        *,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        optimizer: OptimizerFactory | None = None,
        example: tuple[Any, Tensor] | None = None,
        make_head: HeadFactory | None = None,
        graph_warmup: int = 3,
        process_group: Any = None,
        output: Callable[[Any], Tensor] | None = None,
        model_loss: Callable[[Any], Tensor] | None = None,
    ) -> None:
        refuse_unfit(model, plan, process_group)
        self.model, self.plan, self.loss_fn, self.graph_warmup = model, plan, loss_fn, graph_warmup
        self.output, self.model_loss, self.process_group = output, model_loss, process_group
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.cuda = dev.is_cuda(self.device)
        self.graph_owned, self.state, self.capture_retries, self._steps = set(), None, 0, 0
        self._launcher = Launcher(self.device)
        heads, self._first_step = fit_plan(model, plan, example, loss_fn, make_head, output, model_loss)
        self._head_modules = nn.ModuleList(heads.values())
        self.heads = MappingProxyType(heads)
        self._params = list(dict.fromkeys(self.parameters()))
        self._streams = [dev.new_stream(self.device) for _ in range(plan.num_streams)]
        self._stream_done = {i: dev.new_event(self.device) for i in sorted({t.stream for t in plan.targets} - {0})}
        self.capture_stream = dev.new_stream(self.device)
        self._join = LazyJoin(self.device) if self.cuda and any(t.stream for t in plan.targets) else None
        self.optimizer = (optimizer or functools.partial(torch.optim.Adam, lr=1e-3))(self.parameters())
        self._graph = step_graph(self)
        self._patches = Patches()
        self._cut_runners = self._patches.patch_plan(self, model, plan, heads)
        self._reducer = data_parallel(process_group, plan, self._cut_runners, model, self._head_modules,
                                      dict(self._named_parameters()), self.device)

    # -- public API ------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Model parameters, then aux-head parameters (in cut order)."""
        yield from self.model.parameters()
        yield from self._head_modules.parameters()

    def step(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """One training step (zero grads, forward, early + main backward, optimizer). Returns
        the detached total loss ``L_main + Σ λ_i ℓ_i`` as a device tensor (no CPU sync)."""
        inputs = as_tuple(inputs)
        if not torch.is_grad_enabled():
            with torch.enable_grad():
                return self.step(inputs, target)
        if self._graph is not None:
            return self._graph.step(inputs, target)
        return self.eager_step(inputs, target)

    def eager_step(self, inputs: tuple, target: Tensor, dispatch: str | None = None) -> Tensor:
        """One step without a whole-step graph (also the graph's warm-up steps)."""
        self.zero_grad()
        loss = self._forward_backward(inputs, target, dispatch or self.plan.dispatch, self._reducer)
        if not self._steps:
            self._check_first_step()
        self.optimizer_step()
        self._steps += 1
        return loss

    def forward_backward(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """Compute gradients for one batch (no optimizer step, no zeroing); eager path. Under a
        process group the gradients are averaged across it before this returns (every call:
        accumulating over calls sums the averages)."""
        return self._forward_backward(as_tuple(inputs), target, self.plan.dispatch, self._reducer)

    def close(self) -> None:
        """Restore the model's own forwards and stop the worker thread."""
        self._patches.restore()
        if self._reducer is not None:
            self._reducer.close()
        if self._first_step is not None:
            self._first_step.close()
        self._launcher.close()

    def __enter__(self) -> EraseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the runners use (pieces.Host) --------------------------------------------------------

    def side_stream(self, index: int) -> Any:
        return self._streams[index - 1] if index > 0 else None

    def drain_workers(self) -> None:
        """Wait for the worker thread's backward passes to be queued (re-raising their errors)."""
        self._launcher.drain()

    def launch_backward(self, aux: Tensor, stream: Any, index: int) -> None:
        mode = self.state.dispatch if self.state is not None else self.plan.dispatch
        if mode == "deferred":
            self.state.deferred.append(aux)  # type: ignore[union-attr]  # its reduction waits for the main backward
            return
        if mode == "blocking" and stream is None:  # the common case, without the launcher's calls
            aux.backward()
            future = None
        else:
            future = self._launcher.launch(aux, stream, threaded=mode == "threaded")
        self.cut_backward_done(index, stream, future)

    def cut_backward_done(self, index: int, stream: Any, future: Future | None) -> None:
        """Cut ``index``'s local backward is queued (or, with ``future``, will be): under a process
        group with early reduction, issue the reductions that are due, in plan order."""
        if self.state is not None and self.state.reducer is not None:
            self.state.reducer.launched(index, stream, future)

    # -- what the step graph uses (capture.GraphHost) ----------------------------------------------

    def zero_grad(self) -> None:
        owned = self.graph_owned
        for p in self._params:
            if not owned or id(p) not in owned:  # (no id lookup while no graph owns a gradient)
                p.grad = None

    def optimizer_step(self) -> None:
        try:
            self.optimizer.step()
        except RuntimeError as e:
            sparse = [n for n, p in self._named_parameters() if p.grad is not None and p.grad.is_sparse]
            if not sparse or "sparse" not in str(e).lower():
                raise
            names = ", ".join(sparse[:_NAMES_SHOWN]) + (", …" if len(sparse) > _NAMES_SHOWN else "")
            raise EraseTuneError(
                f"optimizer {type(self.optimizer).__name__} cannot take the sparse gradients of {names}: give them "
                "a sparse-capable optimizer (SparseAdam, SGD, Adagrad) in a separate param group or optimizer"
            ) from None

    def reduce_after_replay(self) -> None:
        """Under a process group, after a whole-step replay: average every gradient, then step."""
        if self._reducer is not None:
            self._reducer.reduce_all()
            self.optimizer_step()

    def captured_step(self, inputs: tuple, target: Tensor) -> Tensor:
        """The work a whole-step capture records: forward + backward (no collectives; a blocking
        or deferred launch), then the optimizer unless a process group reduces first."""
        loss = self._forward_backward(inputs, target, capture_dispatch(self.plan.dispatch), None)
        if self._reducer is None:
            self.optimizer.step()
        return loss

    def abandon_step(self) -> None:
        """Forget a step that failed part way (a capture that did not complete)."""
        self.state = None
        self._launcher.forget()

    # -- the forward and backward ------------------------------------------------------------------

    def _forward_backward(self, inputs: tuple, target: Tensor, dispatch: str, reducer: GradReducer | None) -> Tensor:
        if reducer is not None:
            reducer.begin()
        join = self._join
        state = StepState(target=target, join=join, dispatch=dispatch,
                          reducer=early_reducer(reducer, self.plan, self._cut_runners, self.graph_warmup))
        self.state = state
        joined = False
        try:
            with torch.enable_grad():
                with join if join is not None else _NOTHING:
                    out = self.model(*inputs)
                    main = total = main_loss(out, target, self.loss_fn, self.output, self.model_loss)
                    for aux in state.deferred:
                        total = total + aux
                if state.reducer is not None:
                    state.reducer.poll()
                if not getattr(main, "requires_grad", False):
                    check_main_loss(main, self.plan)
                total.backward()
            self._join_streams()
            joined = True
            if reducer is not None:
                reducer.finish()
            if not self._steps:  # here too: a user's own step calls forward_backward alone
                self._check_first_step()
        finally:
            self.state = None
            if join is not None:
                join.end_forward()
                if not joined and not dev.is_capturing(self.device):
                    dev.synchronize(self.device)  # a step that failed part way: side work may still read what it holds
                join.release()  # every side stream's work is ordered before the main stream's from here
        if len(state.deferred) == len(state.aux_values):  # every local loss is in the total already
            return total.detach()
        loss = main.detach()
        for aux in state.aux_values:
            loss = loss + aux
        return loss

    def _join_streams(self) -> None:
        # Kernels must be queued before wait_stream records its event: drain the workers first.
        self._launcher.drain()
        if self._stream_done:
            main = dev.current_stream(self.device)
            for i, done in self._stream_done.items():
                dev.wait_stream(main, self._streams[i - 1], done)

    def _check_first_step(self) -> None:
        """After the first backward: every parameter the plain model trains was reached."""
        check = self._first_step
        if self._steps or check is None or check.done or (self.cuda and torch.cuda.is_current_stream_capturing()):
            return  # (a whole-step capture: nothing to see)
        check.check(self.plan, self._reducer.filled if self._reducer is not None else set())

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.model.named_parameters()
        for name, head in self.heads.items():
            yield from ((f"head[{name}].{n}", p) for n, p in head.named_parameters())
