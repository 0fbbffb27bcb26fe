"""Models for the trust tests: a DLRM-shaped ranking model and a two-tower-and-gate DAG.

Both are shaped like real models that broke plans silently before the probe: DLRM's
embedding tables are called side by side (not a chain), its top MLP ends in a Sigmoid (a
probability output, trained with BCE), its loss is a registered submodule that forward
never calls, and everything upstream of the top MLP reaches the output only through it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

NUM_DENSE = 13
NUM_TABLES = 3
ROWS = 50


class DLRM_Net(nn.Module):  # noqa: N801 (the reference implementation's name, as users know it)
    """Dense features (B, 13), per-table offsets and ids → click probability (B,)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(ROWS, d, mode="sum", sparse=True) for _ in range(NUM_TABLES))
        self.bot_l = nn.Sequential(nn.Linear(NUM_DENSE, 16), nn.ReLU(), nn.Linear(16, d), nn.ReLU())
        pairs = (NUM_TABLES + 1) * NUM_TABLES // 2
        self.top_l = nn.Sequential(nn.Linear(d + pairs, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
        self.loss_fn = nn.BCELoss()  # registered like the reference does; forward never calls it

    def interact(self, x: Tensor, ly: list[Tensor]) -> Tensor:
        vectors = torch.stack([x, *ly], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        rows, cols = torch.triu_indices(len(ly) + 1, len(ly) + 1, offset=1)
        return torch.cat([x, gram[:, rows, cols]], dim=1)

    def forward(self, dense_x: Tensor, offsets: Tensor, indices: Tensor) -> Tensor:
        x = self.bot_l(dense_x)
        ly = [emb(indices[k], offsets[k]) for k, emb in enumerate(self.emb_l)]
        return self.top_l(self.interact(x, ly)).squeeze(-1)


def dlrm_batch(n: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32, bag: int = 2):
    """``((dense, offsets, indices), clicks)``: ``bag`` ids per example and table."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, NUM_DENSE, generator=g, dtype=dtype)
    indices = torch.randint(0, ROWS, (NUM_TABLES, n * bag), generator=g)
    offsets = torch.arange(0, n * bag, bag).expand(NUM_TABLES, n).contiguous()
    clicks = (dense[:, 0] + dense[:, 1] > 0).to(dtype)
    return (dense, offsets, indices), clicks


class Moments(nn.Module):
    """Returns a tuple (mean, spread): a module that cannot be a cut."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.mean(dim=-1, keepdim=True), x.std(dim=-1, keepdim=True)


class TwoTowerGate(nn.Module):
    """(B, 8) → logit (B,): two parallel towers mixed by a gate, then a linear head."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(2))
        self.moments = Moments()
        self.gate = nn.Linear(8 + 2, 1)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.towers[0](x), self.towers[1](x)
        g = torch.sigmoid(self.gate(torch.cat([x, *self.moments(x)], dim=-1)))
        return self.head(g * a + (1 - g) * b).squeeze(-1)
