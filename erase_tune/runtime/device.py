"""Device capabilities, checked in one place.

The engine runs the same code on CPU and CUDA: on the CPU a "stream" is ``None`` and every
stream operation here is a no-op, so early backward simply runs in program order and every
correctness test runs in CI without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def new_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def use_stream(stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` current (no-op for ``None``)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


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
