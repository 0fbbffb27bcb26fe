"""Device capabilities, checked in one place.

The engine runs the same code on CPU and CUDA: on the CPU a "stream" is ``None`` and every
stream operation here is a no-op, so early backward simply runs in program order and every
correctness test runs in CI without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "resolve_device",
    "is_cuda",
    "graphs_supported",
    "is_capturing",
    "current_stream",
    "new_stream",
    "use_stream",
    "wait_stream",
    "record_event",
    "wait_event",
    "record_stream",
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
    return torch.cuda.Stream(device) if device.type == "cuda" else None


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


def wait_stream(consumer, producer) -> None:
    """Work queued on ``consumer`` from now on waits for all work queued on ``producer`` so far."""
    if consumer is not None and producer is not None and consumer != producer:
        consumer.wait_stream(producer)


def record_event(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def record_stream(tensors: Iterator[torch.Tensor], stream, device: torch.device) -> None:
    """Tell the caching allocator that ``stream`` uses these tensors (they crossed streams).

    Also needed under graph capture: the allocator then defers reusing such a block until
    the capture ends, so a side stream's read in the graph cannot race a later write.
    """
    if stream is None:
        return
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
