"""A plain training loop for workload tests (the loop a user writes, no engine)."""

from __future__ import annotations

import torch

from erase_tune.workloads import Workload, WorkloadData


def train(wl: Workload, data: WorkloadData, model: torch.nn.Module, steps: int,
          optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """``steps`` optimizer steps over the workload's batches; returns the training losses."""
    opt = optimizer or wl.optimizer(model.parameters())
    losses = []
    for step in range(steps):
        inputs, target = data.batch(step)
        loss = wl.loss_fn(model(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
