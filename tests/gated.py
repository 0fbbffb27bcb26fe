"""A tiny model whose tower hangs off a gate: cutting the tower alone leaves the gate untrained,
though cutting the gate and the tower together trains both (each by its own local loss).
Named by import path (``tests.gated:workload``), as a user's own workload is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.workloads import Workload, WorkloadData
from erase_tune.workloads.base import prior_entropy

FEATURES = 8


class GatedNet(nn.Module):
    """``tower(gate(x) * x) + wide(x)``: the gate is trained only through the tower."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Sigmoid())  # 72 parameters
        self.tower = nn.Linear(FEATURES, 1)  # 9: the cheapest candidate
        self.wide = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))  # 161

    def forward(self, x: Tensor) -> Tensor:
        return (self.tower(self.gate(x) * x) + self.wide(x)).squeeze(-1)


class _HostCopyGate(nn.Module):
    """A gate that builds a tensor from host data in every forward (as pytorch-fm's offsets do):
    fine eagerly, never inside a CUDA graph capture."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Sigmoid())

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * x.new_tensor([1.0] * FEATURES)


def workload(*, batch: int = 64, train_batches: int = 16, eval_batches: int = 2, host_copy: bool = False) -> Workload:
    """``host_copy``: the gate copies host data to the device in every forward, so a CUDA graph
    of the gate (a per-cut graph, a graphed piece, the whole step) cannot be captured."""

    def build_model() -> nn.Module:
        torch.manual_seed(0)
        model = GatedNet()
        if host_copy:
            model.gate = _HostCopyGate()
        return model

    def make_data(device: torch.device) -> WorkloadData:
        g = torch.Generator().manual_seed(1)
        w = torch.randn(FEATURES, generator=g)

        def one() -> tuple[tuple[Tensor], Tensor]:
            x = torch.randn(batch, FEATURES, generator=g)
            y = (torch.rand(batch, generator=g) < torch.sigmoid(x @ w)).float()
            return (x.to(device),), y.to(device)

        train = [one() for _ in range(train_batches)]
        held = [one() for _ in range(eval_batches)]
        return WorkloadData(train=train, eval=held, prior_entropy=prior_entropy(torch.cat([t.cpu() for _, t in train])))

    return Workload(name="tests.gated:workload",
                    args={"batch": batch, "train_batches": train_batches, "eval_batches": eval_batches,
                          "host_copy": host_copy},
                    build_model=build_model, loss_fn=F.binary_cross_entropy_with_logits, make_data=make_data,
                    cut_candidates=("gate", "tower", "wide"), batch_size=batch,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
