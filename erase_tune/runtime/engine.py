"""The ERASE engine: applies an :class:`ErasePlan` to any ``nn.Module`` and trains it.

Per cut, the engine (without editing the model's code) detaches the piece's input and
output, attaches an aux head, and computes the local loss ``λ·ℓ(head(out), y)`` right after
the piece's forward, on the piece's stream. Its backward is then launched at once — from the
main thread (``blocking``) or a worker thread (``threaded``) — so it overlaps the forward
work that follows on the main stream; or, for ``deferred``, it joins the main loss in one
backward at the end (the "detach only" twin). A placement runs its piece's forward on a side
stream as it is (no detach, no head), so its forward overlaps other work and autograd runs
its backward on the same stream. Outputs of side-stream work are joined lazily, where they
are first used (:mod:`erase_tune.runtime.join`), so sibling pieces run side by side. After
the main backward every side stream is joined back to the current stream before the
optimizer runs.

Exactness: gradients inside each cut and inside the remainder equal those of the reference
objective ``L_main + Σ λ_i ℓ_i`` with stop-gradients at the cut boundaries; placements change
no gradient.

Before training, one probe forward (:mod:`erase_tune.runtime.probe`) checks that the plan
fits the model — every target is called, runs are chains, cuts return one tensor and leave
the main loss a gradient path and every parameter a gradient — and sizes the aux heads. A
plan with no cuts and no placements skips it: it trains exactly like a plain loop.

CUDA graphs: a cut flagged ``graph`` has its forward + local loss + backward captured as its
own graph (own memory pool) after a few eager warm-up calls; a plan with
``whole_step_graph`` captures the whole step (forward, early backwards on their streams, main
backward, optimizer with ``capturable=True``) and replays it. Graph-owned gradients are
overwritten on every replay, so the engine never sets them to ``None``.

Data parallel: with ``process_group=``, gradients are averaged across the group once per step
(:mod:`erase_tune.runtime.reduce`): per cut right after its local backward, in plan order, or
all at the end, as the plan's ``find_unused_parameters`` says; under a whole-step graph, after
the replay, with the optimizer run eagerly. docs/design.md, "Data parallel".

How a piece is applied: the first module of a cut or placement gets an instance-level
``forward`` that runs the whole piece (for a run ``blocks.2:5``: blocks 2, 3, 4 chained);
later blocks of a run become identities while the engine is attached. ``close()`` restores
the model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from erase_tune.errors import CaptureError, EraseTuneError, PlanError, one_line, shown
from erase_tune.runtime import device as dev
from erase_tune.runtime.join import LazyJoin
from erase_tune.runtime.plan import Cut, ErasePlan, Placement
from erase_tune.runtime.probe import ProbeResult, probe, select_output
from erase_tune.runtime.reduce import GradReducer, broadcast_from_rank0, refuse_sparse

__all__ = ["EraseEngine", "LinearHead"]

HeadFactory = Callable[[str, Tensor, Tensor], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_ACTIVATIONS: Mapping[str, Callable[[Tensor], Tensor] | None] = {
    "none": None,
    "sigmoid": torch.sigmoid,
    "softmax": functools.partial(torch.softmax, dim=-1),
    "log_softmax": functools.partial(torch.log_softmax, dim=-1),
}
_NAMES_SHOWN = 5


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


def _default_head(name: str, cut_out: Tensor, model_out: Tensor, *, activation: str = "none") -> nn.Module:
    if not isinstance(model_out, Tensor):
        raise PlanError(f"cut {shown(name)}: the model returns {type(model_out).__name__}, not one tensor, so the "
                        "default aux head cannot match it: pass output= to pick the prediction out of it "
                        "(or make_head with a head for this output)")
    squeeze = model_out.dim() == cut_out.dim() - 1
    out_features = 1 if squeeze else model_out.shape[-1]
    return LinearHead(cut_out.shape[-1], out_features, squeeze, activation)


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _detach(tree: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, tree)


class _Piece:
    """What cuts and placements share: the patched forward of a (run of) module(s)."""

    def __init__(self, engine: EraseEngine, modules: Sequence[nn.Module]) -> None:
        self.engine = engine
        self.modules = list(modules)
        # Bound forwards captured before patching: the piece calls these directly.
        self.forwards = [m.forward for m in self.modules]
        # What each module's instance dict held under "forward" (torch.compile's OptimizedModule,
        # a user's own patch), restored by close(); None: the class's forward.
        self.own_forwards = [m.__dict__.get("forward") for m in self.modules]

    def chain(self, args: tuple, kwargs: dict) -> Any:
        out = self.forwards[0](*args, **kwargs)
        for fwd in self.forwards[1:]:
            out = fwd(out)
        return out

    def __deepcopy__(self, memo: dict) -> Any:
        return _unpatched_copy(self.modules[0], self.own_forwards[0], memo)

    def _enter_stream(self, stream: Any, args: tuple, kwargs: dict) -> tuple[Any, list[Tensor]]:
        """Order ``stream`` after the work its inputs come from; returns (current stream, inputs)."""
        eng = self.engine
        here = dev.current_stream(eng.device)
        inputs = _tensors((args, kwargs))
        dev.wait_stream(stream, here)
        if eng._lazy is not None:
            eng._lazy.consume(inputs, stream if stream is not None else here)
        return here, inputs


class _CutRunner(_Piece):
    """Runs one cut inside a step: detach, stream, local loss, early backward, graphs."""

    def __init__(self, engine: EraseEngine, index: int, cut: Cut, modules: Sequence[nn.Module], head: nn.Module):
        super().__init__(engine, modules)
        self.index = index
        self.cut = cut
        self.head = head
        self.graphed = cut.graph and dev.graphs_supported(engine.device) and not engine.plan.whole_step_graph
        self.params = [p for m in [*self.modules, head] for p in m.parameters() if p.requires_grad]
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[list[Tensor], Tensor, Any, Tensor] | None = None

    def local_loss(self, out: Any, target: Tensor) -> Tensor:
        if not isinstance(out, Tensor):
            raise PlanError(
                f"cut {shown(self.cut.name)}: the module returns {type(out).__name__}, but a cut must return one tensor"
            )
        return self.cut.aux_weight * self.engine.loss_fn(self.head(out), target)

    # -- the patched forward -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        eng = self.engine
        if not eng._in_step:  # evaluation or inference: the plain model
            return self.chain(args, kwargs)
        device = eng.device
        stream = eng._side_stream(self.cut.stream)
        target = eng._target
        with eng._paused():
            _, inputs = self._enter_stream(stream, args, kwargs)
            args, kwargs = _detach(args), _detach(kwargs)
            dev.record_stream(iter([*inputs, target]), stream, device)
        with dev.use_stream(stream):
            if self.graphed and self.calls >= eng.graph_warmup:
                with eng._paused():  # static tensors only: nothing here is a use of side work
                    out, aux = self._replay(args, kwargs, target)
                done = dev.record_event(stream)
                eng._cut_backward_done(self.index, stream, None)
            else:
                with torch.enable_grad():
                    out = self.chain(args, kwargs)
                    aux = self.local_loss(out, target)
                done = dev.record_event(stream)  # before the backward is queued behind it
                eng._launch_backward(aux, stream, self.index)
            self.calls += 1
        with eng._paused():
            out = out.detach()
            if eng._lazy is not None and stream is not None:
                eng._lazy.add([out, aux], inputs, done, stream)  # joined where first used
            eng._aux_values.append(aux.detach())
        return out

    # -- per-cut CUDA graph --------------------------------------------------------------------

    def _replay(self, args: tuple, kwargs: dict, target: Tensor) -> tuple[Tensor, Tensor]:
        if self.graph is None:
            self._capture(args, kwargs, target)
        static_in, static_target, static_out, static_aux = self.static  # type: ignore[misc]
        live = _tensors((args, kwargs))
        for s, x in zip(static_in, live):
            if s.shape != x.shape:
                raise CaptureError(
                    f"cut {shown(self.cut.name)}: captured with input shape {tuple(s.shape)}, got {tuple(x.shape)}; "
                    "per-cut CUDA graphs need static shapes"
                )
            s.copy_(x)
        static_target.copy_(target)
        self.graph.replay()  # type: ignore[union-attr]
        return static_out, static_aux

    def _capture(self, args: tuple, kwargs: dict, target: Tensor) -> None:
        eng = self.engine
        eng._drain_workers()  # no other thread may touch the device while we capture
        static_args, static_kwargs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, (args, kwargs))
        static_in = _tensors((static_args, static_kwargs))
        static_target = target.clone()
        for p in self.params:
            p.grad = None  # allocate the grads from the graph's pool: replays overwrite them
        graph = torch.cuda.CUDAGraph()
        cap = eng._capture_stream
        dev.wait_stream(cap, dev.current_stream(eng.device))
        try:
            with torch.cuda.graph(graph, stream=cap), torch.enable_grad():
                out = self.chain(static_args, static_kwargs)
                aux = self.local_loss(out, static_target)
                aux.backward()
        except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
            raise CaptureError(
                f"cut {shown(self.cut.name)}: CUDA graph capture failed: {one_line(str(e).splitlines()[0])}"
            ) from e
        dev.wait_stream(dev.current_stream(eng.device), cap)
        self.graph = graph
        self.static = (static_in, static_target, out.detach(), aux.detach())
        eng._graph_owned.update(id(p) for p in self.params)


class _PlacedRunner(_Piece):
    """Runs one placement inside a step: the piece's own forward, on its side stream."""

    def __init__(self, engine: EraseEngine, placement: Placement, modules: Sequence[nn.Module]) -> None:
        super().__init__(engine, modules)
        self.placement = placement

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        eng = self.engine
        stream = eng._side_stream(self.placement.stream)
        if not eng._in_step or stream is None or eng._lazy is None:  # on the CPU: the plain forward
            return self.chain(args, kwargs)
        with eng._paused():
            _, inputs = self._enter_stream(stream, args, kwargs)
            dev.record_stream(iter(inputs), stream, eng.device)
            versions = [t._version for t in inputs]
        with dev.use_stream(stream):
            out = self.chain(args, kwargs)
        done = dev.record_event(stream)
        with eng._paused():
            # An input the piece wrote in place is, for later readers, an output of the piece.
            written = [t for t, v in zip(inputs, versions) if t._version != v]
            eng._lazy.add([*_tensors(out), *written], inputs, done, stream)
        return out


class EraseEngine:
    """Train ``model`` under ``plan``: ``engine.step(inputs, target) -> loss``.

    Args:
        model: any ``nn.Module``, already on its device; its code is not edited.
        plan: where to cut and place, and how to run; checked against ``model`` (names, then
            one probe forward: see :mod:`erase_tune.runtime.probe`). A plan that does not fit
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
            as ``DistributedModelParallel`` adds by default, under a plan with cuts or
            placements). Sparse gradients are refused.
        output: optional ``output(model_output) -> prediction`` for a model whose forward
            returns a structure (a tuple, a dict, TorchRec's ``DLRMTrain`` returning
            ``(loss, (loss, logits, labels))``): the main loss is then
            ``loss_fn(output(model_output), target)``, and the probe and the default aux
            heads see the prediction alone. ``None`` (the default) hands ``loss_fn`` the
            model's output as it is.
        model_loss: optional ``model_loss(model_output) -> loss`` for a model that computes
            its own loss (``DLRMTrain``: ``lambda out: out[0]``; its logits in ``out[1]`` are
            detached): that is the main loss, and ``loss_fn`` serves the cuts' local losses
            alone (give it the loss the model uses, on ``output=``'s prediction).
    """

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
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise EraseTuneError(
                "EraseEngine takes the bare module, not DistributedDataParallel: pass model.module and "
                "process_group=...; the engine averages gradients itself (DDP's reducer does not expect the "
                "early backward passes of detached pieces)"
            )
        if plan.cuts or plan.placements:
            _refuse_nested_ddp(model)
        plan.check_model(model)
        self.output = output
        self.model_loss = model_loss
        self.model = model
        self.plan = plan
        self.loss_fn = loss_fn
        self.graph_warmup = graph_warmup
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self._cuda = dev.is_cuda(self.device)
        self._in_step = False
        self._target: Tensor | None = None
        self._aux_values: list[Tensor] = []
        self._deferred: list[Tensor] = []
        self._pending: list[Future] = []
        self._graph_owned: set[int] = set()
        self._dispatch = plan.dispatch
        self._pool: ThreadPoolExecutor | None = None
        self._step_graph: torch.cuda.CUDAGraph | None = None
        self._step_static: tuple[list[Tensor], Tensor, Tensor] | None = None
        self._steps = 0
        self.capture_retries = 0
        """Whole-step captures that failed once and succeeded on the retry."""

        self.process_group = process_group
        self._reducer: GradReducer | None = None
        self._active: GradReducer | None = None  # the reducer of the step in progress
        self._capturing = False

        self._probe: ProbeResult | None = None
        heads: dict[str, nn.Module] = {}
        if plan.cuts or plan.placements:
            result, target = self._check_plan(example)
            heads = self._build_heads(result, target, make_head)
            # Kept for the first step's check; the example's tensors are not needed any more.
            self._probe = dataclasses.replace(result, model_output=None, outputs={})
        self._first_checked = False
        self._reached: set[int] = set()
        self._reach_hooks: list[Any] = []
        self._watch_first_backward()
        self._head_modules = nn.ModuleList(heads.values())
        self.heads: Mapping[str, nn.Module] = MappingProxyType(heads)
        if process_group is not None:
            refuse_sparse(model)
            broadcast_from_rank0([*model.parameters(), *model.buffers(), *self._head_modules.parameters(),
                                  *self._head_modules.buffers()], process_group)
        self._streams = [dev.new_stream(self.device) for _ in range(plan.num_streams)]
        self._capture_stream = dev.new_stream(self.device)
        side_work = any(t.stream for t in (*plan.cuts, *plan.placements))
        self._lazy = LazyJoin(self.device) if self._cuda and side_work else None
        self.optimizer = (optimizer or functools.partial(torch.optim.Adam, lr=1e-3))(self.parameters())
        if plan.whole_step_graph and self._cuda and process_group is None:  # else: eager optimizer
            for group in self.optimizer.param_groups:
                if "capturable" in group:
                    group["capturable"] = True
        self._patched: list[tuple[nn.Module, Any]] = []  # (module, the instance forward it had)
        modules = dict(model.named_modules())
        self._cut_runners: list[_CutRunner] = []
        for i, cut in enumerate(plan.cuts):
            runner = _CutRunner(self, i, cut, [modules[m] for m in cut.members], heads[cut.name])
            self._cut_runners.append(runner)
            self._patch(runner)
        for placement in plan.placements:
            self._patch(_PlacedRunner(self, placement, [modules[m] for m in placement.members]))
        if process_group is not None:
            self._reducer = self._make_reducer(process_group)

    # -- public API ------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Model parameters, then aux-head parameters (in cut order)."""
        yield from self.model.parameters()
        yield from self._head_modules.parameters()

    def step(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """One training step (zero grads, forward, early + main backward, optimizer). Returns
        the detached total loss ``L_main + Σ λ_i ℓ_i`` as a device tensor (no CPU sync)."""
        inputs = _as_tuple(inputs)
        with torch.enable_grad():
            if self.plan.whole_step_graph and self._cuda:
                return self._graph_step(inputs, target)
            self._zero_grad()
            loss = self.forward_backward(inputs, target)
            self._check_first_step()
            self._optimizer_step()
            self._steps += 1
            return loss

    def forward_backward(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """Compute gradients for one batch (no optimizer step, no zeroing); eager path. Under a
        process group the gradients are averaged across it before this returns (every call:
        accumulating over calls sums the averages)."""
        inputs = _as_tuple(inputs)
        self._in_step, self._target = True, target
        self._aux_values, self._deferred = [], []
        reducer = None if self._capturing else self._reducer
        if reducer is not None:
            reducer.begin()
            # A per-cut graph captured in this step must not run beside collectives in flight:
            # that step reduces everything at the end (every rank captures at the same step).
            capture_now = any(r.graphed and r.graph is None and r.calls >= self.graph_warmup for r in self._cut_runners)
            self._active = None if capture_now else reducer
        try:
            with torch.enable_grad():
                with self._joining():
                    out = self.model(*inputs)
                    main = self._main_loss(out, target)
                    total = main + sum(self._deferred) if self._deferred else main
                if self._active is not None:
                    self._active.poll()
                self._check_main_loss(main)
                total.backward()
            self._join()
            if reducer is not None:
                reducer.finish()
            self._check_first_step()  # here too: a user's own step calls forward_backward alone
        finally:
            self._in_step, self._target = False, None
            self._deferred = []
            self._active = None
        loss = main.detach()
        for aux in self._aux_values:
            loss = loss + aux
        self._aux_values = []
        return loss

    def close(self) -> None:
        """Restore exactly the forwards the model had (an instance-level one, as torch.compile
        gives a compiled module, is put back; else the class's) and stop the worker thread."""
        for m, own in reversed(self._patched):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self._patched = []
        for handle in self._reach_hooks:
            handle.remove()
        self._reach_hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> EraseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checking the plan and building the heads -------------------------------------------------

    def _check_plan(self, example: tuple[Any, Tensor] | None) -> tuple[ProbeResult, Tensor]:
        if example is None:
            raise PlanError("EraseEngine needs example=(inputs, target) to check a plan with cuts or placements "
                            "against the model and size its aux heads")
        inputs, target = example
        targets = [t.module for t in (*self.plan.cuts, *self.plan.placements)]
        result = probe(self.model, _as_tuple(inputs), targets, output=self.output, model_loss=self.model_loss)
        result.check_plan(self.plan)
        return result, target

    def _build_heads(self, result: ProbeResult, target: Tensor, make_head: HeadFactory | None) -> dict[str, nn.Module]:
        factory = make_head or functools.partial(_default_head, activation=result.output_activation)
        heads: dict[str, nn.Module] = {}
        for cut in self.plan.cuts:
            out = result.outputs[cut.name]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(cut.name.encode()))  # same head init in every engine
                head = factory(cut.name, out, result.model_output).to(device=out.device, dtype=out.dtype)
            self._check_head(cut.name, head, out, result.model_output, target)
            heads[cut.name] = head
        return heads

    def _check_head(self, name: str, head: nn.Module, out: Tensor, model_out: Any, target: Tensor) -> None:
        fix = "pass make_head with a head for this cut"
        with torch.no_grad():
            try:
                pred = head(out)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise PlanError(f"cut {shown(name)}: the aux head fails on the cut's output "
                                f"({_first_line(e)}); {fix}") from None
            shape = tuple(getattr(model_out, "shape", ()))
            if not isinstance(pred, Tensor) or tuple(pred.shape) != shape:
                got = tuple(pred.shape) if isinstance(pred, Tensor) else type(pred).__name__
                raise PlanError(f"cut {shown(name)}: aux head maps output {tuple(out.shape)} to {got}, "
                                f"but the model's output is {shape}; {fix}")
            try:
                loss = _loss_on_cpu(self.loss_fn, pred, target)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise PlanError(f"cut {shown(name)}: loss_fn does not take the aux head's output "
                                f"({_first_line(e)}); {fix} whose output loss_fn takes") from None
            if not isinstance(loss, Tensor) or not bool(torch.isfinite(loss).all()):
                raise PlanError(f"cut {shown(name)}: loss_fn gives {shown(loss)} on the aux head's output for the "
                                f"example batch; {fix} whose output loss_fn takes (or fix the loss, if it is at fault)")

    # -- internals --------------------------------------------------------------------------------

    def _patch(self, runner: _Piece) -> None:
        first, *rest = runner.modules
        self._patched.append((first, runner.own_forwards[0]))
        first.forward = runner  # instance attribute shadows the class's forward
        for m, own in zip(rest, runner.own_forwards[1:]):
            self._patched.append((m, own))
            m.forward = _Passthrough(m, own)

    def _main_loss(self, out: Any, target: Tensor) -> Tensor:
        """``model_loss(out)`` if the model computes its own, else ``loss_fn`` on the prediction
        (``output(out)`` if the engine has a selector)."""
        if self.model_loss is not None:
            return select_output(self.model_loss, out, "model_loss")
        if self.output is None:
            return self.loss_fn(out, target)
        pred = select_output(self.output, out)
        if torch.is_grad_enabled() and not pred.requires_grad and _tensors(out) and any(
                t.requires_grad for t in _tensors(out)):
            raise EraseTuneError("output=: the prediction it picks is detached in the model's output, so no loss on it "
                                 "trains the model: pass model_loss= to pick the loss the model computes itself "
                                 "(DLRMTrain: lambda out: out[0])")
        return self.loss_fn(pred, target)

    def _side_stream(self, index: int):
        return self._streams[index - 1] if index > 0 else None

    @contextlib.contextmanager
    def _joining(self) -> Iterator[None]:
        """The forward, with side-stream outputs joined where first used (CUDA, side work only)."""
        if self._lazy is None:
            yield
            return
        try:
            with self._lazy:
                yield
        finally:
            self._lazy.clear()

    def _paused(self) -> contextlib.AbstractContextManager:
        return self._lazy.paused() if self._lazy is not None else contextlib.nullcontext()

    def _check_main_loss(self, main: Tensor) -> None:
        if isinstance(main, Tensor) and main.requires_grad:
            return
        if self.plan.cuts:
            raise PlanError(f"the main loss has no gradient path under this plan: its cuts "
                            f"({', '.join(shown(c.module) for c in self.plan.cuts)}) detach every path "
                            "from the model's output to a trainable parameter")
        raise EraseTuneError("the loss does not require grad: no trainable parameter reaches the model's output")

    def _check_first_step(self) -> None:
        """After the first backward: every parameter the plain model trains has a gradient, or
        had one accumulated (an optimizer applied in backward then sets ``.grad`` to None);
        tables a fused kernel updates have no gradient to see (the probe checked them)."""
        if self._steps or self._probe is None or self._first_checked or self._capturing:
            return
        self._first_checked = True
        for handle in self._reach_hooks:
            handle.remove()
        self._reach_hooks = []
        named = dict(self.model.named_parameters())
        filled = self._reducer.filled if self._reducer is not None else set()
        fused = set(self._probe.fused)
        missing = [n for n in self._probe.trainable if n not in fused and (
            (named[n].grad is None and id(named[n]) not in self._reached) or id(named[n]) in filled)]
        self._reached = set()
        if missing:
            raise PlanError(self._probe.starved_message(self.plan, missing))

    def _watch_first_backward(self) -> None:
        """Note every parameter a gradient is accumulated into during the first backward."""
        if self._probe is None:
            return
        named = dict(self.model.named_parameters())
        for n in self._probe.trainable:
            p = named[n]
            if n not in self._probe.fused and p.is_leaf:
                self._reach_hooks.append(p.register_post_accumulate_grad_hook(lambda t: self._reached.add(id(t))))

    def _optimizer_step(self) -> None:
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

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.model.named_parameters()
        for name, head in self.heads.items():
            yield from ((f"head[{name}].{n}", p) for n, p in head.named_parameters())

    def _launch_backward(self, aux: Tensor, stream, index: int) -> None:
        mode = self._dispatch
        if mode == "deferred":
            self._deferred.append(aux)  # its reduction waits for the main backward
        elif mode == "threaded":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="erase-bwd", initializer=self._init_worker)
            future = self._pool.submit(_backward_on, aux, stream)
            self._pending.append(future)
            self._cut_backward_done(index, stream, future)
        else:
            _backward_on(aux, stream)
            self._cut_backward_done(index, stream, None)

    def _cut_backward_done(self, index: int, stream, future: Future | None) -> None:
        """Cut ``index``'s local backward is queued (or, with ``future``, will be): under a process
        group with early reduction, issue the reductions that are due, in plan order."""
        if self._active is not None and not self.plan.find_unused_parameters:
            self._active.launched(index, stream, future)

    def _make_reducer(self, group: Any) -> GradReducer:
        """Per cut, the parameters registered only under its modules, and its head's; the rest."""
        names = {id(p): n for n, p in self._named_parameters()}
        trainable = [p for p in dict.fromkeys(self.parameters()) if p.requires_grad]
        owners: dict[int, list[str]] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for p in m._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(mname)
        cut_params: list[list[nn.Parameter]] = []
        if not self.plan.find_unused_parameters:
            for runner in self._cut_runners:
                members = runner.cut.members
                own = [p for m in runner.modules for p in m.parameters() if p.requires_grad]
                inside = [p for p in own
                          if all(any(o == m or o.startswith(m + ".") for m in members) for o in owners[id(p)])]
                head = [p for p in runner.head.parameters() if p.requires_grad]
                cut_params.append(list(dict.fromkeys([*inside, *head])))
        early = {id(p) for ps in cut_params for p in ps}
        rest = [p for p in trainable if id(p) not in early]
        return GradReducer(group, [c.name for c in self.plan.cuts] if cut_params else [], cut_params, rest,
                           names, self.device)

    def _init_worker(self) -> None:
        if self._cuda:  # a worker thread does not inherit the current device
            torch.cuda.set_device(self.device)

    def _drain_workers(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a worker's exception in the training thread

    def _join(self) -> None:
        # Kernels must be queued before wait_stream records its event: drain the workers first.
        self._drain_workers()
        main = dev.current_stream(self.device)
        for s in self._streams:
            dev.wait_stream(main, s)

    def _zero_grad(self) -> None:
        for p in self.parameters():
            if id(p) not in self._graph_owned:
                p.grad = None

    def _graph_step(self, inputs: tuple, target: Tensor) -> Tensor:
        main = dev.current_stream(self.device)
        cap = self._capture_stream
        if self._step_graph is None:
            self._dispatch = "deferred" if self.plan.dispatch == "deferred" else "blocking"
            if self._steps < self.graph_warmup:  # eager warm-up on a side stream, as capture requires
                dev.wait_stream(cap, main)
                with dev.use_stream(cap):
                    self._zero_grad()
                    loss = self.forward_backward(inputs, target)
                    self._check_first_step()
                    self._optimizer_step()
                dev.wait_stream(main, cap)
                self._steps += 1
                return loss
            self._capture_step(inputs, target)
        static_in, static_target, static_loss = self._step_static  # type: ignore[misc]
        live = _tensors(inputs)
        if len(live) != len(static_in) or any(s.shape != x.shape or s.dtype != x.dtype for s, x in zip(static_in, live)):
            raise CaptureError(
                "whole-step CUDA graph was captured for inputs "
                f"{[tuple(s.shape) for s in static_in]}, got {[tuple(x.shape) for x in live]}; it needs static shapes"
            )
        for s, x in zip(static_in, live):
            s.copy_(x)
        static_target.copy_(target)
        self._step_graph.replay()  # type: ignore[union-attr]
        if self._reducer is not None:  # collectives and the optimizer run after the replay, eagerly
            self._reducer.reduce_all()
            self._optimizer_step()
        self._steps += 1
        return static_loss

    def _capture_step(self, inputs: tuple, target: Tensor) -> None:
        main = dev.current_stream(self.device)
        cap = self._capture_stream
        static_inputs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, inputs)
        static_target = target.clone()
        # One retry: a capture can be invalidated by unrelated work elsewhere in the process
        # (seen once on an H200 with the GPT proxy); a second failure is the workload's own.
        for attempt in (1, 2):
            for p in self.parameters():
                p.grad = None  # grads come from the graph's pool; every replay overwrites them
            graph = torch.cuda.CUDAGraph()
            dev.wait_stream(cap, main)
            self._capturing = True  # under a process group: forward + backward only, no collective
            try:
                with torch.cuda.graph(graph, stream=cap):
                    loss = self.forward_backward(static_inputs, static_target)
                    if self._reducer is None:
                        self.optimizer.step()
                break
            except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
                self._deferred, self._aux_values, self._pending = [], [], []
                if attempt == 2:
                    raise CaptureError(
                        f"whole-step CUDA graph capture failed ({one_line(str(e).splitlines()[0])}); the step must "
                        "have static shapes and no CPU syncs (.item(), .cpu(), data-dependent control flow)"
                    ) from e
                self.capture_retries += 1
                dev.synchronize(self.device)
            finally:
                self._capturing = False
        dev.wait_stream(main, cap)
        self._graph_owned.update(id(p) for p in self.parameters())
        self._step_graph = graph
        self._step_static = (_tensors(static_inputs), static_target, loss)


def _backward_on(aux: Tensor, stream) -> None:
    # The gradient seed is created on the current stream: make it the cut's stream.
    with dev.use_stream(stream):
        aux.backward()


def _loss_on_cpu(loss_fn: Callable[[Tensor, Tensor], Tensor], pred: Tensor, target: Tensor) -> Any:
    """``loss_fn(pred, target)``, on CPU copies where the loss allows: a CUDA loss kernel given
    out-of-range input (BCE on logits) fails with a device-side assert that ends the process's
    CUDA context, while on the CPU it is an ordinary error."""
    if pred.device.type == "cpu":
        return loss_fn(pred, target)
    try:
        return loss_fn(pred.cpu(), target.cpu())
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if "device" not in str(e):
            raise
    return loss_fn(pred, target)  # the loss holds device state of its own (a weight, a module)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return one_line(text[0] if text else type(e).__name__)[:200]


class _Passthrough:
    """Forward of a later block of a run: the run's first block already applied it."""

    def __init__(self, module: nn.Module, own: Any = None) -> None:
        self.module = module
        self.own = own

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    def __deepcopy__(self, memo: dict) -> Any:
        return _unpatched_copy(self.module, self.own, memo)


def _unpatched_copy(module: nn.Module, own: Any, memo: dict) -> Any:
    # A deep copy of a model with an engine attached is a plain model: its copied modules get
    # back the forward they had before the engine (copy.deepcopy registers the copy in memo
    # before its state): the instance one they held (a compiled module's), else their class's.
    if own is not None:
        return copy.deepcopy(own, memo)
    copied = memo.get(id(module), module)
    return type(copied).forward.__get__(copied)


def _refuse_nested_ddp(model: nn.Module) -> None:
    """DDP inside the model reduces in its own order from autograd hooks, which a cut's early
    backward fires mid-forward: one line naming the wrapped module instead of DDP's error."""
    for name, m in model.named_modules():
        if name and isinstance(m, nn.parallel.DistributedDataParallel):
            raise EraseTuneError(
                f"module {shown(name)} is wrapped in DistributedDataParallel inside the model (as "
                "DistributedModelParallel does by default): its reducer cannot follow the early backward passes of "
                "a plan's pieces; build the model without that wrapper (DistributedModelParallel: pass a "
                "data_parallel_wrapper that does not wrap, on one rank)"
            )


def _as_tuple(inputs: Any) -> tuple:
    if isinstance(inputs, Tensor):
        return (inputs,)
    return tuple(inputs)
