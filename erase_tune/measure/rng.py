"""The random numbers one training run draws, kept apart from every other run's.

A trial steps the baseline and the candidate in alternation in one process. Their dropout
masks (and any other draw from torch's global generators during a step) would otherwise come
from one shared sequence: the baseline's step 0 takes the first masks, the candidate's step 0
the next ones. A plan that changes no gradient would then still train another model than its
reference, read an NE gap, and fail the exactness check.

:class:`SeededRandom` gives each run its own copy of torch's global generator state (the CPU
generator, and the device's on CUDA), started from one seed: the runs a trial compares draw the
same masks at the same step, whatever they are interleaved with. Runs meant to differ (the noise
floor's repeats, the quality confirmation's seeds) start from different seeds, so the model's
own randomness is part of the noise they measure.

Covered: whatever draws from torch's default generators during a step (``nn.Dropout``,
``torch.rand*``, ``torch.randn*``, ``torch.bernoulli``, ...), eager or replayed from a CUDA graph.
Not covered: Python's ``random`` and NumPy's generators, and generators a model creates itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

GlobalState = tuple[torch.Tensor, torch.Tensor | None]
"""torch's global generator states: the CPU one and, on CUDA, the device's."""


def global_state(device: torch.device) -> GlobalState:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_global_state(device: torch.device, state: GlobalState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class SeededRandom:
    """One run's own random numbers: ``with r.drawing(): step()`` makes the step draw from this
    run's sequence and leaves the global generators as they were (a few microseconds a step)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.seed = seed
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = torch.Generator(device=device).manual_seed(seed).get_state() if device.type == "cuda" else None
        self._state: GlobalState = (cpu, cuda)

    @property
    def state(self) -> GlobalState:
        """Where this run's sequence stands (to start another run at the same draw)."""
        return self._state

    @state.setter
    def state(self, value: GlobalState) -> None:
        self._state = value

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        outside = global_state(self.device)
        set_global_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = global_state(self.device)
            set_global_state(self.device, outside)
