"""A tiny ranking model whose whole step cannot be captured as one CUDA graph.

Like the reference DLRM's dot interaction, its forward builds the index tensors of the
pairwise products on the host in every step (``torch.triu_indices`` on the CPU) and indexes a
CUDA tensor with them: eager training is fine, a whole-step CUDA graph capture fails ("Cannot
copy between CPU and CUDA tensors during CUDA graph capture"). Named by import path
(``tests.host_index:workload``), as a user's own workload is, so Ray workers can build it.
With ``sync=True`` the forward also reads a value back to the host (``.item()``), which
invalidates the capture on the device itself (the case that can leave the process's CUDA RNG
in capture state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.workloads import Workload, WorkloadData
from erase_tune.workloads.base import prior_entropy

FEATURES = 8


class HostIndexNet(nn.Module):
    """Three towers over the dense features, their pairwise dot products, a top MLP → logit."""

    def __init__(self, width: int, sync: bool = False) -> None:
        super().__init__()
        self.sync = sync
        self.bottom = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, FEATURES), nn.ReLU())
        self.left = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(FEATURES + 3, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x: Tensor) -> Tensor:
        if self.sync and x.abs().max().item() > 1e6:  # a host read-back: never true, always a sync
            x = x / 1e6
        a, b, c = self.bottom(x), self.left(x), self.right(x)
        vectors = torch.stack([a, b, c], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        rows, cols = torch.triu_indices(3, 3, offset=1)  # on the host, every step (as the reference DLRM)
        return self.top(torch.cat([a, gram[:, rows, cols]], dim=1)).squeeze(-1)


def workload(*, batch: int = 64, width: int = 16, train_batches: int = 16, eval_batches: int = 2,
             sync: bool = False) -> Workload:
    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return HostIndexNet(width, sync)

    def make_data(device: torch.device) -> WorkloadData:
        gen = torch.Generator().manual_seed(1)
        teacher = torch.randn(FEATURES, generator=gen)

        def one() -> tuple[tuple[Tensor], Tensor]:
            x = torch.randn(batch, FEATURES, generator=gen)
            y = (x @ teacher + 0.5 * torch.randn(batch, generator=gen) > 0).float()
            return (x.to(device),), y.to(device)

        train = [one() for _ in range(train_batches)]
        held = [one() for _ in range(eval_batches)]
        return WorkloadData(train=train, eval=held, prior_entropy=prior_entropy(torch.cat([t.cpu() for _, t in train])))

    return Workload(name="tests.host_index:workload",
                    args={"batch": batch, "width": width, "train_batches": train_batches, "eval_batches": eval_batches,
                          "sync": sync},
                    build_model=build_model, loss_fn=F.binary_cross_entropy_with_logits, make_data=make_data,
                    cut_candidates=("left", "right"), batch_size=batch,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
