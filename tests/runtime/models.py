"""A small model with the shapes ERASE cares about: parallel towers and a chain of blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Residual block; the residual lives inside, so blocks chain as ``x = block(x)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Toy(nn.Module):
    """(B, 8) → logit (B,): embed, a chain of 4 blocks, three towers, an over-arch.

    The embedding also feeds the over-arch directly (as DLRM's dense vector does), so it
    keeps a gradient whichever blocks and towers a plan cuts.
    """

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 8)) for _ in range(3)
        )
        self.over = nn.Linear(2 * d + 3 * 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        z = h
        for block in self.blocks:
            z = block(z)
        outs = [tower(h) for tower in self.towers]
        return self.over(torch.cat([z, h, *outs], dim=-1)).squeeze(-1)


def toy_batch(n: int = 32, seed: int = 0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=dtype)
    y = (x[:, 0] * x[:, 1] > 0).to(dtype)
    return (x.to(device),), y.to(device)


loss_fn = F.binary_cross_entropy_with_logits
