"""A workload that cannot be captured gets a clear CaptureError, not a CUDA crash."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from erase_tune import CaptureError, EraseEngine, ErasePlan

pytestmark = pytest.mark.gpu


class Syncing(nn.Module):
    """Reads a value back to the CPU mid-forward (a CPU sync: not capturable)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if x.abs().max().item() > 1 else 1.0
        return (self.fc(x) * scale).squeeze(-1)


def _batch(n: int, device: str = "cuda"):
    x = torch.randn(n, 8, device=device)
    return (x,), (x[:, 0] > 0).float()


def test_cpu_sync_in_the_step_is_a_capture_error():
    engine = EraseEngine(Syncing().cuda(), ErasePlan(whole_step_graph=True), loss_fn=F.binary_cross_entropy_with_logits)
    for _ in range(3):  # eager warm-up works
        engine.step(*_batch(64))
    with pytest.raises(CaptureError, match="whole-step CUDA graph capture failed.*no CPU syncs"):
        engine.step(*_batch(64))
    torch.cuda.synchronize()  # the device is still usable
    assert torch.ones(2, device="cuda").sum().item() == 2


def test_a_new_shape_after_capture_is_a_capture_error():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Flatten(0))
    engine = EraseEngine(model.cuda(), ErasePlan(whole_step_graph=True), loss_fn=F.binary_cross_entropy_with_logits)
    for _ in range(5):
        engine.step(*_batch(64))
    with pytest.raises(CaptureError, match="static shapes"):
        engine.step(*_batch(32))
