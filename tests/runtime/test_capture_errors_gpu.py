"""A workload that cannot be captured gets a clear CaptureError, not a CUDA crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from erase_tune import CaptureError, EraseEngine, ErasePlan  # noqa: F401 (CaptureError: in the subprocess too)

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
    # In a subprocess: on torch 2.11 a failed capture leaves the process's CUDA RNG in capture
    # state ("Offset increment outside graph capture" at the next torch.randn on the GPU), which
    # would poison later tests. Trial workers are fresh processes for the same reason.
    code = (
        "import torch, torch.nn.functional as F\n"
        "from erase_tune import CaptureError, EraseEngine, ErasePlan  # noqa: F401 (CaptureError: in the subprocess too)\n"
        "from tests.runtime.test_capture_errors_gpu import Syncing, _batch\n"
        "engine = EraseEngine(Syncing().cuda(), ErasePlan(whole_step_graph=True), "
        "loss_fn=F.binary_cross_entropy_with_logits)\n"
        "batches = [_batch(64) for _ in range(4)]\n"
        "for b in batches[:3]: engine.step(*b)\n"
        "try:\n"
        "    engine.step(*batches[3])\n"
        "except CaptureError as e:\n"
        "    print('CAPTURE-ERROR', e)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CAPTURE-ERROR"))
    assert "whole-step CUDA graph capture failed" in line and "no CPU syncs" in line


def test_a_new_shape_after_capture_is_a_capture_error():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Flatten(0))
    engine = EraseEngine(model.cuda(), ErasePlan(whole_step_graph=True), loss_fn=F.binary_cross_entropy_with_logits)
    for _ in range(5):
        engine.step(*_batch(64))
    with pytest.raises(CaptureError, match="static shapes"):
        engine.step(*_batch(32))
