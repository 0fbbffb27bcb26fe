"""Device capabilities, checked in one place.

The engine runs the same code on CPU and CUDA: on the CPU a "stream" is ``None`` and every
stream operation here is a no-op, so early backward simply runs in program order and every
correctness test runs in CI without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "resolve_device",
    "is_cuda",
    "graphs_supported",
    "is_capturing",
    "current_stream",
    "new_stream",
    "new_event",
    "Side",
    "side",
    "use_stream",
    "wait_stream",
    "record_event",
    "wait_event",
    "synchronize",
]

Stream = "torch.cuda.Stream | None"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` picks CUDA when available; ``"cuda"`` without a GPU is an error."""
    from erase_tune.errors import EraseTuneError, one_line, shown

    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        # torch's message quotes the whole string: cut it, a 10 kB --device is one line still
        raise EraseTuneError(f"device: {shown(device)} is not a device ({one_line(str(e), 200)})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EraseTuneError("device: cuda asked for, but no CUDA device is available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise EraseTuneError(f"device: {shown(device)} is not supported (cpu or cuda)")
    return dev


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def graphs_supported(device: torch.device) -> bool:
    """CUDA graphs exist only on CUDA devices; elsewhere graph flags run eagerly."""
    return device.type == "cuda"


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_STREAMS: dict[tuple[int, int, int], Any] = {}
"""Stream objects by torch's (stream id, device index, device type): ``torch.cuda.current_stream``
builds a new Python ``Stream`` (and resolves the device) on every call, several µs each, and a
placement asks for the current stream a few times per step; a stream's identity never changes."""


def current_stream(device: torch.device):
    if device.type != "cuda":
        return None
    key = torch._C._cuda_getCurrentStream(device.index if device.index is not None else torch._C._cuda_getDevice())
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def new_stream(device: torch.device):
    """A new side stream (None on the CPU), registered so that :func:`current_stream` returns this
    very object while it is current: the runtime compares and keys streams by identity."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    _STREAMS[(stream.stream_id, stream.device_index, stream.device_type)] = stream
    return stream


def new_event(device: torch.device):
    """An event to record again and again (one per piece or stream: :func:`record_event`)."""
    return torch.cuda.Event() if device.type == "cuda" else None


def use_stream(stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` current (no-op for ``None``)."""
    return _StreamSwitch(stream) if stream is not None else contextlib.nullcontext()


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` without its Python overhead (it resolves the device and
    builds a ``Stream`` for the previous stream on every entry): torch's own C-level calls, for
    a stream on the current device; another device's stream goes through ``torch.cuda.stream``."""

    __slots__ = ("stream", "previous", "fallback")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.previous: tuple[int, int, int] | None = None
        self.fallback: Any = None

    def __enter__(self) -> None:
        s = self.stream
        if s.device_index != torch._C._cuda_getDevice():
            self.fallback = torch.cuda.stream(s)
            self.fallback.__enter__()
            return
        self.previous = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def __exit__(self, *exc: object) -> None:
        if self.fallback is not None:
            self.fallback.__exit__(*exc)
            return
        sid, index, kind = self.previous  # type: ignore[misc]
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=kind)


# torch's C-level event calls (``torch.cuda.Event.record``/``.wait`` and ``Stream.wait_stream``
# are Python wrappers around them that resolve the current stream or build a new event).
_EventBase = getattr(torch._C, "_CudaEventBase", None)
_record = getattr(_EventBase, "record", None)
_wait = getattr(_EventBase, "wait", None)


def wait_stream(consumer, producer, event=None) -> None:
    """Work queued on ``consumer`` from now on waits for all work queued on ``producer`` so far
    (through ``event``, recorded again, when given)."""
    if consumer is not None and producer is not None and consumer is not producer:
        _wait(record_event(producer, event), consumer)


def record_event(stream, event=None):
    """Record ``event`` (a new one when None) on ``stream``.

    An event can be recorded again and again, under graph capture too: ``cudaStreamWaitEvent``
    waits for the record that was the event's latest when the wait was queued, and every wait
    the runtime queues follows its own record."""
    if stream is None:
        return None
    if event is None:
        event = torch.cuda.Event()
    _record(event, stream)
    return event


def wait_event(stream, event) -> None:
    if stream is not None and event is not None:
        _wait(event, stream)


class Side:
    """A piece's side stream, entered and left with torch's C-level calls and two events that
    are recorded again on every call: no Python ``Stream`` or ``Event`` is built per call.

    :meth:`enter` makes the side stream wait for the calling stream and makes it current (it
    returns the calling stream); :meth:`mark` records the piece's end on the side stream;
    :meth:`restore` makes the calling stream current again. Pieces never nest, so one piece's
    ``Side`` is entered once at a time."""

    __slots__ = ("stream", "entered", "done", "_index", "_args", "_previous", "_fallback")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.entered = torch.cuda.Event()
        """Recorded on the calling stream at entry; the side stream waits for it."""
        self.done = torch.cuda.Event()
        """Recorded on the side stream by :meth:`mark`; readers of the piece's outputs wait for it."""
        self._index = stream.device_index
        self._args = (stream.stream_id, stream.device_index, stream.device_type)
        self._previous: tuple[int, int, int] | None = None
        self._fallback: Any = None

    def enter(self):
        key = torch._C._cuda_getCurrentStream(self._index)
        here = _STREAMS.get(key)
        if here is None:
            here = current_stream(torch.device("cuda", self._index))
        _record(self.entered, here)
        _wait(self.entered, self.stream)
        if torch._C._cuda_getDevice() != self._index:  # another device is current: torch's own way
            self._fallback = torch.cuda.stream(self.stream)
            self._fallback.__enter__()
        else:
            self._previous = key
            torch._C._cuda_setStream(*self._args)
        return here

    def mark(self):
        _record(self.done, self.stream)
        return self.done

    def restore(self) -> None:
        if self._fallback is not None:
            fallback, self._fallback = self._fallback, None
            fallback.__exit__(None, None, None)
        else:
            torch._C._cuda_setStream(*self._previous)  # type: ignore[misc]


def side(stream) -> Side | None:
    """The :class:`Side` of a piece on ``stream`` (None: no side stream, or the CPU)."""
    return Side(stream) if stream is not None else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
