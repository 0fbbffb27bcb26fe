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

import contextlib
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
    if type(tree) is tuple:  # the common case, tensors only: no generator frames
        out = []
        for x in tree:
            if not isinstance(x, Tensor):
                break
            out.append(x.detach())
        else:
            return tuple(out)
    if isinstance(tree, (tuple, list, dict)):
        return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, tree) if tree else tree
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
        if not self._pending:
            return
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
    if stream is None:
        aux.backward()
        return
    with dev.use_stream(stream):
        aux.backward()


class _Piece:
    """What every runner shares: the patched forward of a (run of) module(s), and the way a
    piece takes its inputs from other streams and hands its outputs on.

    For the common piece (tensors in, a tensor or a tuple of tensors out) that is a fixed
    handful of C-level calls: the side stream entered and left through a
    :class:`~erase_tune.runtime.device.Side` (two events recorded again every call, no new
    event or stream objects), no walks of nested structures, and the join's bookkeeping."""

    def __init__(self, host: Host, modules: Sequence[nn.Module], stream: int = 0) -> None:
        self.host = host
        self.modules = list(modules)
        self.stream = host.side_stream(stream)
        """The piece's side stream (None: the current stream, or the CPU)."""
        self.side = dev.side(self.stream)
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

    def _inputs(self, join: LazyJoin, args: tuple, kwargs: dict, on: Any) -> tuple[tuple, dict, list[Tensor]]:
        """Order stream ``on`` (the piece's) after the side work its inputs come from; the
        inputs with pending aliases stripped, and the list of input tensors."""
        pending = False
        if not kwargs:
            for a in args:
                if type(a) is Pending:
                    pending = True
                elif not isinstance(a, Tensor):
                    break
            else:  # tensors only (the common case): no walk
                if not pending:
                    return args, kwargs, list(args)
                join.pause_depth += 1  # another side piece's output: wait for it, then its plain tensor
                try:
                    for a in args:
                        join.consume_one(a, on)
                    args = tuple(a.as_subclass(Tensor) if type(a) is Pending else a for a in args)
                finally:
                    join.pause_depth -= 1
                return args, kwargs, list(args)
        join.pause_depth += 1  # a structure: walk it
        try:
            join.consume(tensors_in((args, kwargs)), on)
            args, kwargs = _plain(args), _plain(kwargs)
        finally:
            join.pause_depth -= 1
        return args, kwargs, tensors_in((args, kwargs))

    def _on_side(self, join: LazyJoin, args: tuple, kwargs: dict, run: Callable[[tuple, dict], Any]) -> Any:
        """``run(args, kwargs)`` on this piece's side stream: its inputs joined there first, its
        outputs handed on to the join (the placed and the graphed runners' side-stream path)."""
        side = self.side
        side.enter()
        try:
            args, kwargs, inputs = self._inputs(join, args, kwargs, side.stream)
            versions = [t._version for t in inputs]
            out = run(args, kwargs)
        finally:
            done = side.mark()
            side.restore()
        return self._hand_on(join, out, inputs, versions, done)

    def _hand_on(self, join: LazyJoin, out: Any, inputs: list[Tensor], versions: list[int], done: Any) -> Any:
        """Register the side forward's outputs with the join; what the model gets instead."""
        # An input the piece wrote in place is, for later readers, an output of the piece.
        written = [t for t, v in zip(inputs, versions) if t._version != v]
        if isinstance(out, Tensor):
            return join.add([out], inputs, done, self.stream, written)[0]
        if type(out) is tuple and all(isinstance(x, Tensor) for x in out):
            return tuple(join.add(out, inputs, done, self.stream, written))
        outs = tensors_in(out)
        handed = join.add(outs, inputs, done, self.stream, written)
        if not any(h is not t for h, t in zip(handed, outs)):
            return out
        swap = {id(t): h for t, h in zip(outs, handed)}
        return tree_map(lambda x: swap.get(id(x), x) if isinstance(x, Tensor) else x, out)


class CutRunner(_Piece):
    """Runs one cut inside a step: detach, stream, local loss, early backward, graphs."""

    def __init__(self, host: Host, index: int, cut: Cut, modules: Sequence[nn.Module], head: nn.Module,
                 graphed: bool):
        super().__init__(host, modules, cut.stream)
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
        stream, side, target, join = self.stream, self.side, state.target, state.join
        here = side.enter() if side is not None else None
        try:
            if join is not None:
                on = stream if stream is not None else dev.current_stream(host.device)
                args, kwargs, inputs = self._inputs(join, args, kwargs, on)
                join.hold(target)  # read on the cut's stream
            args = _detached(args)
            if kwargs:
                kwargs = _detached(kwargs)
            replayed = self.graphed and self.calls >= host.graph_warmup
            if replayed:  # the graph ran the local backward too
                out, aux = self._replay(args, kwargs, target)
            elif torch.is_grad_enabled():  # (the engine's steps)
                out = self.chain(args, kwargs)
                aux = self.local_loss(out, target)
            else:
                with torch.enable_grad():
                    out = self.chain(args, kwargs)
                    aux = self.local_loss(out, target)
            out, aux_value = out.detach(), aux.detach()  # (before the join may make aux pending)
            aux_seen = aux
            if side is not None and join is not None:
                done = side.mark()  # before the backward is queued behind it
                if state.dispatch == "deferred":  # the main stream reads the local loss in the forward
                    out, aux_seen = join.add([out, aux], inputs, done, stream)
                else:  # it reads it after the step's streams are joined
                    (out,) = join.add([out], inputs, done, stream)
            if replayed:
                host.cut_backward_done(self.index, stream, None)
            else:
                host.launch_backward(aux if state.dispatch != "deferred" else aux_seen, stream, self.index)
            self.calls += 1
        finally:
            if here is not None:
                side.restore()  # type: ignore[union-attr]
        state.aux_values.append(aux_value)
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
        # Captured on the stream it replays on: graphs captured on one stream share that stream's
        # cuBLAS workspace, so two cuts' graphs replaying side by side on two streams must not
        # come from one capture stream (their GEMMs would race on the workspace).
        cap = self.stream if self.stream is not None else host.capture_stream
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
        super().__init__(host, modules, placement.stream)
        self.placement = placement

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state, side = self.host.state, self.side
        join = state.join if state is not None else None
        if join is None or side is None:  # outside a step, or on the CPU: the plain forward
            return self.chain(args, kwargs)
        return self._on_side(join, args, kwargs, self.chain)


class GraphedRunner(_Piece):
    """Runs one graphed piece inside a step: eager for the warm-up calls, then captured (forward
    and backward) with ``torch.cuda.make_graphed_callables`` and replayed, on its stream.

    The replay is one autograd node whose backward replays the backward graph, so gradients
    are those of the plain step (the same kernels on the same values). Each piece gets its own
    memory pool. On the CPU, and outside a step, it is the plain forward.
    """

    def __init__(self, host: Host, graphed: Graphed, modules: Sequence[nn.Module]) -> None:
        super().__init__(host, modules, graphed.stream)
        self.graphed = graphed
        self.calls = 0
        self.replayed: Callable[..., Any] | None = None
        self.signature: list[tuple[tuple[int, ...], torch.dtype, bool]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        host, state = self.host, self.host.state
        if state is None or not host.cuda:
            return self.chain(args, kwargs)
        side, join = self.side, state.join
        if side is None or join is None:  # on the main stream: wait for pending inputs, strip them
            if join is not None:
                args, kwargs, _ = self._inputs(join, args, kwargs, dev.current_stream(host.device))
            return self._run(args, kwargs)
        return self._on_side(join, args, kwargs, self._run)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        out = self.chain(args, kwargs) if self.calls < self.host.graph_warmup else self._replay(args, kwargs)
        self.calls += 1
        return out

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
            # Its warm-up runs draw from the device's generator: put it back, so the replays draw
            # the random numbers (dropout masks) the eager piece would have drawn here.
            drawn = torch.cuda.get_rng_state(host.device)
            with _capture_stream(self.stream):
                self.replayed = torch.cuda.make_graphed_callables(piece, sample, allow_unused_input=True)
            torch.cuda.set_rng_state(drawn, host.device)
        except (RuntimeError, AssertionError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
            raise CaptureError(f"graphed piece {shown(self.graphed.name)}: CUDA graph capture failed: "
                               f"{one_line(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)}"
                               ) from e
        finally:
            if join is not None:
                join.pause_depth -= 1
        self.signature = sig


@contextlib.contextmanager
def _capture_stream(stream: Any) -> Any:
    """``make_graphed_callables`` captures on ``torch.cuda.graph``'s one default stream, so every
    piece captured by it shares that stream's cuBLAS workspace: a piece that replays on a side
    stream, beside others, is captured on that side stream instead (None: the default)."""
    cls = torch.cuda.graph
    if stream is None or not hasattr(cls, "default_capture_stream"):
        yield
        return
    saved = cls.default_capture_stream
    cls.default_capture_stream = stream
    try:
        yield
    finally:
        cls.default_capture_stream = saved


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
