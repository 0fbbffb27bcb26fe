"""Lazy joins: a stream waits for side-stream work only where it first uses that work's output.

Cuts, placements and graphed pieces run their forward on side streams. Making the main
stream wait for each one right after it was launched would serialise sibling pieces
(subarchs 0..5, each called one after the other, each waiting for the previous). Instead
every tensor a side forward produces is *pending* with the event recorded when that forward
was done, and the current stream waits for that event when an op is about to read the
tensor: once per (tensor, consuming stream), since a stream that waited once is ordered after
the event for good. The same op calls ``record_stream`` so the allocator does not hand the
tensor's memory to its producing stream while the consumer may still read it.

Writes need the reverse order: an in-place op (or ``out=``) on a tensor that an in-flight
side forward still reads waits for that forward first. A side forward that writes one of
its own inputs in place makes that input pending, like an output.

Two ways of seeing the ops, one bookkeeping:

- *guarded*: a :class:`~torch.overrides.TorchFunctionMode`, active during the forward, sees
  every op (reads and writes). Sure, but it costs every torch call of the forward a Python
  round trip (several µs each: on a host-bound model that is more than any overlap gives).
- *fast*: the pending outputs are handed to the model as :class:`Pending` tensors (an alias of
  the output, in the same autograd graph), whose ``__torch_function__`` joins; only the ops
  that read a pending tensor pay. Writes to the storage of a side forward's inputs are then not
  seen as they happen, so the fast way is used only for a model whose first guarded forward
  showed no such write (nor a side forward writing its own inputs), and every later forward
  checks the inputs' version counters at its end: a write it finds switches the join back to
  guarded for the steps after (with a warning), and a side forward found writing its own input
  switches it at once.

Metadata reads (shape, dtype, ...) never wait. Only ops that reach ``__torch_function__``
are seen (every ``torch.*``, ``Tensor`` method and ``torch.ops`` call is; a C++ extension
bound directly with pybind11 is not). Mode stacks are per thread, so a worker
thread that launches an early backward is not affected; autograd does not go through
``__torch_function__`` at all, and runs each backward op on its forward's stream with its
own cross-stream waits. On the CPU streams and events are ``None``: nothing waits, and the
bookkeeping still runs (which is how it is tested without a GPU).
"""

from __future__ import annotations

import contextlib
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


class Pending(Tensor):
    """A side forward's output as the model sees it in the fast way: the first op that reads
    it (on any stream) waits for the side forward's event first. Results of ops are plain
    tensors; the alias stays in the autograd graph like the output itself."""

    _erase_join: LazyJoin

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _is_metadata(func):
            for t in _tensors(args, kwargs):
                join = getattr(t, "_erase_join", None)
                if join is not None and not join.pause_depth:
                    join.consume((t,), join.stream_now())
        with torch._C.DisableTorchFunctionSubclass():
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
        self._mode_on = False
        self._versions: list[tuple[Tensor, int]] = []  # fast way: side inputs and their version after the read
        self._pending: dict[int, tuple[Tensor, Any, Any]] = {}  # id -> (tensor, done event, its stream)
        self._joined: set[tuple[int, Any]] = set()  # (id of tensor, consuming stream) already handled
        self._waited: set[tuple[int, Any]] = set()  # (id of done event, stream) already waited on
        self._read: dict[tuple[int, int], list[Any]] = {}  # storage key -> done events of side readers
        self._readers: list[Tensor] = []  # held until clear(), so no other tensor reuses their memory
        self.pause_depth = 0
        """Above 0 while ops run that are no uses of side work: the join's own bookkeeping
        (:meth:`paused`), a runner entering a side piece or capturing one (it raises this
        counter, then lowers it: cheaper than a context manager on every call)."""

    # -- what the engine tells it -------------------------------------------------------------------

    def add(self, outputs: Iterable[Tensor], inputs: Iterable[Tensor], done: Any, stream: Any,
            written: Iterable[Tensor] = ()) -> list[Tensor]:
        """A side forward on ``stream`` made ``outputs`` from ``inputs`` (writing ``written`` of
        them in place); ``done`` marks its end. Returns the outputs to hand on: the same tensors
        when guarded, :class:`Pending` aliases in the fast way."""
        written = list(written)
        self.pause_depth += 1
        try:
            if written:  # later readers of these must wait, and only the mode sees them
                self.hazards += 1
                self.escalate("a side forward writes its own input in place")
            for t in (*outputs, *written):  # held until clear(): ids stay unique while the tensors live
                self._pending[id(t)] = (t, done, stream)
            for t in inputs:
                key = _storage_key(t)
                if key is not None:
                    self._read.setdefault(key, []).append(done)
                    self._readers.append(t)
                    if not self.guarded:
                        self._versions.append((t, t._version))
            if self.guarded:
                return list(outputs)
            handed = []
            for t in outputs:
                alias = t.as_subclass(Pending)
                alias._erase_join = self
                self._pending[id(alias)] = (alias, done, stream)
                self._readers.append(alias)
                handed.append(alias)
            return handed
        finally:
            self.pause_depth -= 1

    def stream_now(self) -> Any:
        return dev.current_stream(self.device)

    def escalate(self, why: str) -> None:
        """Switch to the guarded way now, for the rest of this forward and the ones after."""
        if not self.guarded:
            log.warning("erase-tune: %s; joins are checked op by op from now on (slower, still correct)", why)
        self.guarded = True
        if not self._mode_on and self._entered:
            super().__enter__()
            self._mode_on = True

    def consume(self, tensors: Iterable[Tensor], stream: Any) -> None:
        """Order ``stream`` after the producers of any pending tensor among ``tensors``."""
        with self.paused():
            for t in tensors:
                entry = self._pending.get(id(t))
                if entry is None or (id(t), stream) in self._joined:
                    continue
                self._joined.add((id(t), stream))
                self.joins += 1
                _, done, producer = entry
                if stream == producer:
                    continue
                dev.record_stream(iter([t]), stream, self.device)
                if (id(done), stream) not in self._waited:  # outputs of one forward share its event
                    self._waited.add((id(done), stream))
                    dev.wait_event(stream, done)
                    self.waits += 1

    def before_write(self, tensors: Iterable[Tensor], stream: Any) -> None:
        """Order ``stream`` after every in-flight side forward that reads any of ``tensors``."""
        with self.paused():
            for t in tensors:
                key = _storage_key(t)
                for done in self._read.get(key, ()) if key is not None else ():
                    dev.wait_event(stream, done)
                    self.waits += 1
                    self.hazards += 1

    # -- around one forward -----------------------------------------------------------------------

    _entered = False

    def __enter__(self) -> LazyJoin:
        self._entered = True
        if self.guarded:
            super().__enter__()
            self._mode_on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode_on:
            super().__exit__(*exc)
            self._mode_on = False
        self._entered = False
        if any(t._version != v for t, v in self._versions):
            self.hazards += 1
            self.escalate("the model wrote a tensor in place while a side stream could still read it")
        self._versions.clear()
        if not self.verified:  # the first (guarded) forward decides whether the fast way is safe
            self.verified = True
            self.guarded = self.hazards > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engine's own bookkeeping ops (detach, record_stream) are not uses."""
        self.pause_depth += 1
        try:
            yield
        finally:
            self.pause_depth -= 1

    def clear(self) -> None:
        """Forget this forward's side work (the engine joins every side stream at step end)."""
        self._pending.clear()
        self._joined.clear()
        self._waited.clear()
        self._read.clear()
        self._readers.clear()

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
