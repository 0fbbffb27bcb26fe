"""The plan's elements at work inside a step: one runner per cut, placement or graphed piece.

The engine patches the first module of each element with a runner (an instance-level
``forward``); later blocks of a run become identities. A runner does its element's job when
called inside a step and is the plain forward outside one (evaluation, inference):

- :class:`CutRunner`: detach in and out, the piece's forward and its aux head's local loss on
  the cut's stream, then its backward launched at once (blocking, threaded) or kept for the
  end (deferred); optionally the piece's forward + local loss + backward as its own CUDA graph.
- :class:`PlacedRunner`: the piece's own forward on a side stream, nothing detached.
- :class:`GraphedRunner`: the piece's forward and backward captured once as CUDA graphs
  (``torch.cuda.make_graphed_callables``) and replayed from then on, nothing detached;
  optionally on a side stream.

What a runner needs from its engine is the :class:`Host` protocol (what lasts across steps)
and the :class:`StepState` of the step in progress (``host.state``, None between steps), so a
runner reads no private field of the engine. Everything a runner does per call is a fixed
amount of host work, whatever the size of the model around it: the side-stream outputs it
hands on are joined where first read (:mod:`erase_tune.runtime.join`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from erase_tune.errors import CaptureError, PlanError, one_line, shown
from erase_tune.runtime import device as dev
from erase_tune.runtime.join import LazyJoin, Pending
from erase_tune.runtime.plan import Cut, Graphed, Placement

if TYPE_CHECKING:
    from erase_tune.runtime.reduce import GradReducer

__all__ = ["Host", "StepState", "Launcher", "CutRunner", "PlacedRunner", "GraphedRunner", "Passthrough", "tensors_in"]


@dataclasses.dataclass(eq=False)
class StepState:
    """What one step's forward accumulates, handed to the runners (reset every step)."""

    target: Any
    """The batch's target: each cut's local loss compares against it."""
    join: LazyJoin | None
    """Side-stream outputs of this forward, joined where first used (None: no side work)."""
    dispatch: str
    """How cuts launch their backward in this step (a whole-step capture runs blocking)."""
    aux_values: list[Tensor] = dataclasses.field(default_factory=list)
    """Each cut's local loss (detached), for the step's reported loss."""
    deferred: list[Tensor] = dataclasses.field(default_factory=list)
    """Local losses whose backward joins the main loss's (``deferred`` dispatch)."""
    reducer: GradReducer | None = None
    """Issues each cut's gradient averaging right after its backward, in plan order (None: this
    step issues none early: no process group, ``find_unused_parameters``, a per-cut capture)."""


class Host(Protocol):
    """What a runner uses of its engine (it lasts across steps)."""

    device: torch.device
    cuda: bool
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    graph_warmup: int
    capture_stream: Any
    graph_owned: set[int]
    state: StepState | None

    def side_stream(self, index: int) -> Any: ...
    def drain_workers(self) -> None: ...
    def launch_backward(self, aux: Tensor, stream: Any, index: int) -> None: ...
    def cut_backward_done(self, index: int, stream: Any, future: Future | None) -> None: ...


def tensors_in(tree: Any) -> list[Tensor]:
    """The tensors in what a piece takes or returns: nested tuples, lists and dicts read
    directly (the common case, cheap), anything else through pytree (a structure a library
    registered there, such as TorchRec's jagged tensors)."""
    if isinstance(tree, Tensor):
        return [tree]
    out: list[Tensor] = []
    if isinstance(tree, (tuple, list)):
        for x in tree:
            out.extend(tensors_in(x))
    elif isinstance(tree, dict):
        for x in tree.values():
            out.extend(tensors_in(x))
    elif tree is not None and not isinstance(tree, (int, float, str, bool)):
        out.extend(x for x in tree_flatten(tree)[0] if isinstance(x, Tensor))
    return out


def _detached(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return tree.detach()
    if isinstance(tree, (tuple, list, dict)):
        return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, tree)
    return tree


def _plain(tree: Any) -> Any:
    """``tree`` with :class:`Pending` aliases swapped for the tensors they stand for (a side piece
    waits for its inputs once, on entry; its own ops need not pass through the join again)."""
    if isinstance(tree, Pending):
        return tree.as_subclass(Tensor)
    if isinstance(tree, tuple):
        return tuple(_plain(x) for x in tree)
    if isinstance(tree, list):
        return [_plain(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


class Launcher:
    """Who launches a cut's early backward: the training thread (``blocking``), or one worker
    thread (``threaded``) so the training thread keeps dispatching the forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []  # backward passes the worker has not queued yet

    def launch(self, aux: Tensor, stream: Any, *, threaded: bool) -> Future | None:
        """``aux.backward()`` on ``stream``; with ``threaded``, on the worker (its future returned)."""
        if not threaded:
            _backward_on(aux, stream)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="erase-bwd", initializer=self._init_worker)
        future = self._pool.submit(_backward_on, aux, stream)
        self._pending.append(future)
        return future

    def drain(self) -> None:
        """Wait until the worker has queued every backward it was given (re-raising its errors)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a worker's exception in the training thread

    def forget(self) -> None:
        self._pending = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _init_worker(self) -> None:
        if dev.is_cuda(self.device):  # a worker thread does not inherit the current device
            torch.cuda.set_device(self.device)


def _backward_on(aux: Tensor, stream: Any) -> None:
    # The gradient seed is created on the current stream: make it the cut's stream.
    with dev.use_stream(stream):
        aux.backward()


class _Piece:
    """What every runner shares: the patched forward of a (run of) module(s)."""

    def __init__(self, host: Host, modules: Sequence[nn.Module]) -> None:
        self.host = host
        self.modules = list(modules)
        # Bound forwards captured before patching: the piece calls these directly.
        self.forwards = [m.forward for m in self.modules]
        # What each module's instance dict held under "forward" (torch.compile's OptimizedModule,
        # a user's own patch): a deep copy gets it back; None: the class's forward.
        self.own_forwards = [m.__dict__.get("forward") for m in self.modules]

    def chain(self, args: tuple, kwargs: dict) -> Any:
        out = self.forwards[0](*args, **kwargs)
        for fwd in self.forwards[1:]:
            out = fwd(out)
        return out

    def __deepcopy__(self, memo: dict) -> Any:
        return _unpatched_copy(self.modules[0], self.own_forwards[0], memo)

    def _enter(self, stream: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[Tensor]]:
        """Order ``stream`` after the work its inputs come from; the inputs, joins stripped."""
        host = self.host
        join = host.state.join if host.state is not None else None
        if join is None:
            return args, kwargs, []
        join.pause_depth += 1
        try:
            here = dev.current_stream(host.device)
            dev.wait_stream(stream, here)
            inputs = tensors_in((args, kwargs))
            join.consume(inputs, stream if stream is not None else here)
            args, kwargs = _plain(args), _plain(kwargs)
            inputs = tensors_in((args, kwargs))
            dev.record_stream(iter(inputs), stream, host.device)
        finally:
            join.pause_depth -= 1
        return args, kwargs, inputs

    def _hand_on(self, out: Any, inputs: list[Tensor], versions: list[int], stream: Any,
                 extra: Sequence[Tensor] = ()) -> Any:
        """Register the side forward's outputs with the join; what the model gets instead."""
        join = self.host.state.join  # type: ignore[union-attr]
        done = dev.record_event(stream)
        # An input the piece wrote in place is, for later readers, an output of the piece.
        written = [t for t, v in zip(inputs, versions) if t._version != v]
        outs = tensors_in(out)
        handed = join.add([*outs, *extra], inputs, done, stream, written)
        if not any(h is not t for h, t in zip(handed, outs)):
            return out
        swap = {id(t): h for t, h in zip(outs, handed)}
        return tree_map(lambda x: swap.get(id(x), x) if isinstance(x, Tensor) else x, out)


class CutRunner(_Piece):
    """Runs one cut inside a step: detach, stream, local loss, early backward, graphs."""

    def __init__(self, host: Host, index: int, cut: Cut, modules: Sequence[nn.Module], head: nn.Module,
                 graphed: bool):
        super().__init__(host, modules)
        self.index = index
        self.cut = cut
        self.head = head
        self.graphed = graphed
        self.params = [p for m in [*self.modules, head] for p in m.parameters() if p.requires_grad]
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[list[Tensor], Tensor, Any, Tensor] | None = None

    def local_loss(self, out: Any, target: Tensor) -> Tensor:
        if not isinstance(out, Tensor):
            raise PlanError(
                f"cut {shown(self.cut.name)}: the module returns {type(out).__name__}, but a cut must return one tensor"
            )
        return self.cut.aux_weight * self.host.loss_fn(self.head(out), target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host, state = self.host, self.host.state
        if state is None:  # evaluation or inference: the plain model
            return self.chain(args, kwargs)
        stream = host.side_stream(self.cut.stream)
        target = state.target
        args, kwargs, inputs = self._enter(stream, args, kwargs)
        args, kwargs = _detached(args), _detached(kwargs)
        if state.join is not None:
            dev.record_stream(iter([target]), stream, host.device)
        with dev.use_stream(stream):
            replayed = self.graphed and self.calls >= host.graph_warmup
            if replayed:  # the graph ran the local backward too
                out, aux = self._replay(args, kwargs, target)
            else:
                with torch.enable_grad():
                    out = self.chain(args, kwargs)
                    aux = self.local_loss(out, target)
            out = out.detach()
            if state.join is not None and stream is not None:
                done = dev.record_event(stream)  # before the backward is queued behind it
                handed = state.join.add([out, aux], inputs, done, stream)
                out, aux_seen = handed[0], handed[1]
            else:
                aux_seen = aux
            if replayed:
                host.cut_backward_done(self.index, stream, None)
            else:
                host.launch_backward(aux if state.dispatch != "deferred" else aux_seen, stream, self.index)
            self.calls += 1
        state.aux_values.append(aux.detach())
        return out

    # -- per-cut CUDA graph --------------------------------------------------------------------

    def _replay(self, args: tuple, kwargs: dict, target: Tensor) -> tuple[Tensor, Tensor]:
        if self.graph is None:
            self._capture(args, kwargs, target)
        static_in, static_target, static_out, static_aux = self.static  # type: ignore[misc]
        live = tensors_in((args, kwargs))
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
        host = self.host
        host.drain_workers()  # no other thread may touch the device while we capture
        static_args, static_kwargs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, (args, kwargs))
        static_in = tensors_in((static_args, static_kwargs))
        static_target = target.clone()
        for p in self.params:
            p.grad = None  # allocate the grads from the graph's pool: replays overwrite them
        graph = torch.cuda.CUDAGraph()
        cap = host.capture_stream
        dev.wait_stream(cap, dev.current_stream(host.device))
        try:
            with torch.cuda.graph(graph, stream=cap), torch.enable_grad():
                out = self.chain(static_args, static_kwargs)
                aux = self.local_loss(out, static_target)
                aux.backward()
        except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
            raise CaptureError(
                f"cut {shown(self.cut.name)}: CUDA graph capture failed: {one_line(str(e).splitlines()[0])}"
            ) from e
        dev.wait_stream(dev.current_stream(host.device), cap)
        self.graph = graph
        self.static = (static_in, static_target, out.detach(), aux.detach())
        host.graph_owned.update(id(p) for p in self.params)


class PlacedRunner(_Piece):
    """Runs one placement inside a step: the piece's own forward, on its side stream."""

    def __init__(self, host: Host, placement: Placement, modules: Sequence[nn.Module]) -> None:
        super().__init__(host, modules)
        self.placement = placement

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host, state = self.host, self.host.state
        stream = host.side_stream(self.placement.stream)
        if state is None or stream is None or state.join is None:  # on the CPU: the plain forward
            return self.chain(args, kwargs)
        args, kwargs, inputs = self._enter(stream, args, kwargs)
        versions = [t._version for t in inputs]
        with dev.use_stream(stream):
            out = self.chain(args, kwargs)
        return self._hand_on(out, inputs, versions, stream)


class GraphedRunner(_Piece):
    """Runs one graphed piece inside a step: eager for the warm-up calls, then captured (forward
    and backward) with ``torch.cuda.make_graphed_callables`` and replayed, on its stream.

    The replay is one autograd node whose backward replays the backward graph, so gradients
    are those of the plain step (the same kernels on the same values). Each piece gets its own
    memory pool. On the CPU, and outside a step, it is the plain forward.
    """

    def __init__(self, host: Host, graphed: Graphed, modules: Sequence[nn.Module]) -> None:
        super().__init__(host, modules)
        self.graphed = graphed
        self.calls = 0
        self.replayed: Callable[..., Any] | None = None
        self.signature: list[tuple[tuple[int, ...], torch.dtype, bool]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host, state = self.host, self.host.state
        if state is None or not host.cuda:
            return self.chain(args, kwargs)
        stream = host.side_stream(self.graphed.stream)
        placed = stream is not None and state.join is not None
        args, kwargs, inputs = self._enter(stream, args, kwargs)  # waits for pending inputs, strips them
        versions = [t._version for t in inputs] if placed else []
        with dev.use_stream(stream):
            if self.calls < host.graph_warmup:
                out = self.chain(args, kwargs)
            else:
                out = self._replay(args, kwargs)
        self.calls += 1
        return self._hand_on(out, inputs, versions, stream) if placed else out

    def _replay(self, args: tuple, kwargs: dict) -> Any:
        name = shown(self.graphed.name)
        if kwargs or not all(isinstance(a, Tensor) for a in args):
            raise CaptureError(f"graphed piece {name}: a CUDA-graphed piece must take tensors only, as positional "
                               "arguments (it got keyword or non-tensor arguments); keep it eager")
        sig = [(tuple(a.shape), a.dtype, a.requires_grad) for a in args]
        if self.replayed is None:
            self._capture(args, sig)
        elif sig != self.signature:
            raise CaptureError(f"graphed piece {name}: captured for inputs {_shapes(self.signature)}, got "
                               f"{_shapes(sig)}; a CUDA-graphed piece needs static shapes")
        return self.replayed(*args)  # type: ignore[misc]

    def _capture(self, args: tuple, sig: list) -> None:
        host = self.host
        host.drain_workers()  # no other thread may touch the device while we capture
        join = host.state.join if host.state is not None else None
        if join is not None:
            join.pause_depth += 1  # the capture's own ops are no uses of side work
        try:
            sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
            piece = _Chain(self.modules, self.forwards)
            self.replayed = torch.cuda.make_graphed_callables(piece, sample, allow_unused_input=True)
        except (RuntimeError, AssertionError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
            raise CaptureError(f"graphed piece {shown(self.graphed.name)}: CUDA graph capture failed: "
                               f"{one_line(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)}"
                               ) from e
        finally:
            if join is not None:
                join.pause_depth -= 1
        self.signature = sig


class _Chain(nn.Module):
    """A graphed piece as the module ``make_graphed_callables`` captures: its blocks'
    parameters (registered, so their gradients are computed) and their original forwards."""

    def __init__(self, modules: Sequence[nn.Module], forwards: Sequence[Callable[..., Any]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(modules)
        self._forwards = list(forwards)

    def forward(self, *args: Tensor) -> Any:
        out = self._forwards[0](*args)
        for fwd in self._forwards[1:]:
            out = fwd(out)
        return out


def _shapes(sig: Sequence[tuple[tuple[int, ...], torch.dtype, bool]] | None) -> str:
    return ", ".join(f"{list(s)} {str(d).removeprefix('torch.')}" for s, d, _ in sig or ())


class Passthrough:
    """Forward of a later block of a run: the run's first block already applied it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.own = module.__dict__.get("forward")  # the instance forward it shadows, if any

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
