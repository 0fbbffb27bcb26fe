"""Lazy joins: a stream waits for side-stream work only where it first uses that work's output.

Cuts, placements and graphed pieces run their forward on side streams. Making the main
stream wait for each one right after it was launched would serialise sibling pieces
(subarchs 0..5, each called one after the other, each waiting for the previous). Instead
every tensor a side forward produces is *pending* with the event recorded when that forward
was done, and the current stream waits for that event when an op is about to read the
tensor: once per (tensor, consuming stream), since a stream that waited once is ordered after
the event for good.

Memory that crosses streams is not handed back to the allocator early: the join holds a
reference to every side forward's inputs and outputs (and the cuts' targets) until
:meth:`LazyJoin.release`, which the engine calls once the main stream has waited for every side
stream at the end of the step. Until then no tensor that crossed streams is freed, so the
allocator cannot give its memory to a stream while another may still read it; after it, every
stream that reuses the memory is ordered after those reads. (This replaces ``record_stream``,
whose deferred frees the allocator re-checks with an event query at every allocation.)

Writes need the reverse order: an in-place op (or ``out=``) on a tensor that an in-flight
side forward still reads waits for that forward first. A side forward that writes one of
its own inputs in place makes that input pending, like an output.

Two ways of seeing the ops, one bookkeeping:

- *guarded*: a :class:`~torch.overrides.TorchFunctionMode`, active during the forward, sees
  every op (reads and writes). Sure, but it costs every torch call of the forward a Python
  round trip (several µs each: on a host-bound model that is more than any overlap gives).
- *fast*: the pending outputs are handed to the model as :class:`Pending` tensors (the output
  itself, its class swapped; an alias for an output of a tensor subclass), whose
  ``__torch_function__`` joins; only the ops that read a pending tensor pay, and only until the
  forward's own stream has waited for it: it is then a plain tensor again (its class swapped
  back), so later ops on it stay in C++, and so is every pending tensor at the forward's end. Writes to the storage of a side forward's inputs are not seen as they happen, so the
  fast way is used only for a model whose first guarded forward showed no such write (nor a
  side forward writing its own inputs), and every later forward checks the inputs' version
  counters at its end: a write it finds switches the join back to guarded for the steps after
  (with a warning), and a side forward found writing its own input switches it at once.

Metadata reads (shape, dtype, ...) never wait. Only ops that reach ``__torch_function__``
are seen (every ``torch.*``, ``Tensor`` method and ``torch.ops`` call is; a C++ extension
bound directly with pybind11 is not). Mode stacks are per thread, so a worker
thread that launches an early backward is not affected; autograd does not go through
``__torch_function__`` at all, and runs each backward op on its forward's stream with its
own cross-stream waits. Streams are compared and keyed by identity (the runtime's streams are
the objects :func:`erase_tune.runtime.device.current_stream` returns). On the CPU streams and
events are ``None``: nothing waits, and the bookkeeping still runs (which is how it is tested
without a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from erase_tune.runtime import device as dev

__all__ = ["LazyJoin", "Pending"]

log = logging.getLogger("erase_tune")

_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
                            "xor", "lshift", "rshift")
) | {"__setitem__"}
_GETSETS = ("shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "is_cuda", "ndim", "layout",
            "is_sparse", "_version", "grad")
_METHODS = ("size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size", "storage_offset",
            "get_device", "data_ptr", "untyped_storage", "is_floating_point", "is_complex", "__len__")
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _GETSETS] + [getattr(torch.Tensor, name) for name in _METHODS]
)
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass


class Pending(Tensor):
    """A side forward's output as the model sees it in the fast way (the output itself, its
    class swapped, or an alias of an output of another tensor subclass): the first op that reads
    it on a stream waits for the side forward's event first. Results of ops are plain tensors.
    Once the forward's own stream has waited for it, it is a plain :class:`~torch.Tensor` again."""

    _erase_join: LazyJoin

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if not _is_metadata(func):
            stream = None
            for t in _tensors(args, kwargs) if kwargs else _args_tensors(args):
                if type(t) is Pending:
                    join = t._erase_join
                    if not join.pause_depth:
                        if stream is None:
                            stream = join.stream_now()
                        join.consume_one(t, stream)
        with _NO_SUBCLASS():
            return func(*args, **kwargs)


class LazyJoin(TorchFunctionMode):
    """Tracks side-stream outputs and inputs within one forward; see the module docstring.

    Used as a context manager around the forward: guarded, it enters the mode; fast, it
    only checks, on leaving, that no side forward's input was written while it ran.
    """

    def __init__(self, device: torch.device, *, guarded: bool = True) -> None:
        super().__init__()
        self.device = device
        self.guarded = guarded
        """Whether the next forward sees every op (the mode) or only pending tensors' readers."""
        self.verified = not guarded
        """Whether a guarded forward has run and shown whether the fast way is safe."""
        self.hazards = 0
        """Writes seen to a side forward's inputs, by the mode or by version counters."""
        self.waits = 0
        """Events waited on so far (for tests and diagnostics)."""
        self.joins = 0
        """Pending tensors first read on some stream so far (on the CPU too, where nothing waits)."""
        self.ops_seen = 0
        """Ops the mode intercepted so far: what the guarded way costs (0 while fast)."""
        self.main: Any = None
        """The stream the forward in progress runs on (set on entering)."""
        self._mode_on = False
        self._adds = 0  # side forwards registered this step: tells apart the records of a re-recorded event
        self._versions: list[tuple[Tensor, int]] = []  # fast way: side inputs and their version after the read
        self._unkeyed: list[tuple[Tensor, Any]] = []  # fast way: side inputs and their readers' done events
        self._pending: dict[int, tuple[Tensor, Any, Any, int]] = {}  # id -> (tensor, done event, stream, add)
        self._joined: set[tuple[int, int]] = set()  # (id of tensor, id of consuming stream) already handled
        self._waited: set[tuple[int, int]] = set()  # (add, id of stream) already waited on
        self._read: dict[tuple[int, int], list[Any]] = {}  # storage key -> done events of side readers
        self._held: list[Tensor] = []  # tensors that crossed streams: freed only at release()
        self.pause_depth = 0
        """Above 0 while ops run that are no uses of side work: the join's own bookkeeping, a
        runner entering a side piece or capturing one (it raises this counter, then lowers it)."""

    # -- what the engine tells it -------------------------------------------------------------------

    def add(self, outputs: Iterable[Tensor], inputs: Iterable[Tensor], done: Any, stream: Any,
            written: Iterable[Tensor] = ()) -> list[Tensor]:
        """A side forward on ``stream`` made ``outputs`` from ``inputs`` (writing ``written`` of
        them in place); ``done`` marks its end. Returns the outputs to hand on: the same tensors
        when guarded, :class:`Pending` aliases in the fast way. Inputs and outputs are held
        until :meth:`release`."""
        self.pause_depth += 1
        try:
            self._adds += 1
            token = self._adds
            held = self._held
            if written:  # later readers of these must wait, and only the mode sees them
                self.hazards += 1
                self.escalate("a side forward writes its own input in place")
                for t in written:
                    self._pending[id(t)] = (t, done, stream, token)
            for t in outputs:
                self._pending[id(t)] = (t, done, stream, token)
                held.append(t)
            for t in inputs:
                held.append(t)
                if self.guarded:
                    self._key(t, done)
                else:
                    self._versions.append((t, t._version))
                    self._unkeyed.append((t, done))
            if self.guarded:
                return list(outputs)
            handed = []
            for t in outputs:
                if type(t) is Tensor:  # the output itself becomes pending (no alias, no autograd node)
                    t.__class__ = Pending
                    alias = t
                else:  # a subclass of its own (a Parameter, a wrapper): an alias of it
                    alias = t.as_subclass(Pending)
                    self._pending[id(alias)] = (alias, done, stream, token)
                    held.append(alias)
                alias._erase_join = self
                handed.append(alias)
            return handed
        finally:
            self.pause_depth -= 1

    def hold(self, tensor: Tensor) -> None:
        """Keep ``tensor`` (read on a side stream, not a side forward's input) until :meth:`release`."""
        self._held.append(tensor)

    def stream_now(self) -> Any:
        return dev.current_stream(self.device)  # (a cached object: streams are compared by identity)

    def escalate(self, why: str) -> None:
        """Switch to the guarded way now, for the rest of this forward and the ones after."""
        if not self.guarded:
            log.warning("erase-tune: %s; joins are checked op by op from now on (slower, still correct)", why)
        self.guarded = True
        for t, done in self._unkeyed:
            self._key(t, done)
        self._unkeyed.clear()
        if not self._mode_on and self._entered:
            super().__enter__()
            self._mode_on = True

    def consume(self, tensors: Iterable[Tensor], stream: Any) -> None:
        """Order ``stream`` after the producers of any pending tensor among ``tensors``."""
        for t in tensors:
            self.consume_one(t, stream)

    def consume_one(self, t: Tensor, stream: Any) -> None:
        """Order ``stream`` after the producer of ``t``, if it is pending and ``stream`` has not
        waited for it yet; read on the forward's own stream, a :class:`Pending` alias becomes a
        plain tensor."""
        entry = self._pending.get(id(t))
        if entry is None:
            return
        key = (id(t), id(stream))
        if key in self._joined:
            return
        self._joined.add(key)
        self.joins += 1
        _, done, producer, token = entry
        if stream is self.main and type(t) is Pending:
            t.__class__ = Tensor  # the forward's stream is ordered after it for good: no more joins
        if stream is producer:
            return
        waited = (token, id(stream))
        if waited not in self._waited:  # outputs of one side forward share its event
            self._waited.add(waited)
            dev.wait_event(stream, done)
            self.waits += 1

    def before_write(self, tensors: Iterable[Tensor], stream: Any) -> None:
        """Order ``stream`` after every in-flight side forward that reads any of ``tensors``."""
        self.pause_depth += 1
        try:
            for t in tensors:
                key = _storage_key(t)
                for done in self._read.get(key, ()) if key is not None else ():
                    dev.wait_event(stream, done)
                    self.waits += 1
                    self.hazards += 1
        finally:
            self.pause_depth -= 1

    def _key(self, t: Tensor, done: Any) -> None:
        key = _storage_key(t)
        if key is not None:
            self._read.setdefault(key, []).append(done)

    # -- around one forward -----------------------------------------------------------------------

    _entered = False

    def __enter__(self) -> LazyJoin:
        self._entered = True
        self.main = dev.current_stream(self.device)
        if self.guarded:
            super().__enter__()
            self._mode_on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode_on:
            super().__exit__(*exc)
            self._mode_on = False
        self._entered = False
        if self._versions and any(t._version != v for t, v in self._versions):
            self.hazards += 1
            self.escalate("the model wrote a tensor in place while a side stream could still read it")
        self._versions.clear()
        if not self.verified:  # the first (guarded) forward decides whether the fast way is safe
            self.verified = True
            self.guarded = self.hazards > 0

    def end_forward(self) -> None:
        """Forget this forward's pending work (its tensors stay held until :meth:`release`); a
        pending tensor nothing read in the forward is a plain tensor again."""
        if self._pending:
            for t, *_ in self._pending.values():
                if type(t) is Pending:
                    t.__class__ = Tensor
            self._pending.clear()
            self._joined.clear()
            self._waited.clear()
        self._read.clear()
        self._unkeyed.clear()

    def release(self) -> None:
        """Let go of the tensors that crossed streams: call it once every side stream's work is
        ordered before the stream that goes on (the engine joins them at the end of the step)."""
        self._held.clear()
        self._adds = 0

    def clear(self) -> None:
        """Forget this forward's side work and let go of its tensors."""
        self.end_forward()
        self.release()

    # -- the mode -------------------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops_seen += 1
        if not self.pause_depth and (self._pending or self._read) and not _is_metadata(func):
            stream = dev.current_stream(self.device)
            self.consume(_tensors(args, kwargs), stream)
            written = _written(func, args, kwargs)
            if written and self._read:
                self.before_write(written, stream)
        return func(*args, **kwargs)


def _is_metadata(func: Any) -> bool:
    try:
        return func in _METADATA
    except TypeError:  # an unhashable callable is no metadata getter
        return False


def _args_tensors(args: tuple) -> Iterator[Tensor]:
    """Tensors among positional arguments, one level into lists and tuples."""
    for value in args:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def _tensors(args: tuple, kwargs: dict) -> Iterator[Tensor]:
    """Tensors among the arguments, one level into lists, tuples and dicts (``cat``'s list)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, Tensor))


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """Tensors the op writes: ``self`` of an in-place op, ``out=``, an ``inplace=True`` input."""
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
    out: list[Tensor] = []
    if (inplace or kwargs.get("inplace") is True) and args and isinstance(args[0], Tensor):
        out.append(args[0])
    dest = kwargs.get("out")
    if isinstance(dest, Tensor):
        out.append(dest)
    elif isinstance(dest, (list, tuple)):
        out.extend(t for t in dest if isinstance(t, Tensor))
    return out


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    """Identifies the memory ``t`` lives in (views share it); None for an empty storage."""
    if t.layout != torch.strided:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without plain storage (a wrapper subclass)
        return None
    return (t.device.index or 0, ptr) if ptr else None
