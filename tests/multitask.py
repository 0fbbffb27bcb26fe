"""A two-task model as a new user writes it: ``tests.multitask:workload``.

A shared bottom MLP and two towers, click (ends in a sigmoid, trained with BCE on
probabilities) and conversion (ends in a raw logit, trained with BCE on logits); the model
returns a list ``[click probability, conversion logit]`` and each batch's target is (B, 2):
column 0 the clicks, column 1 the conversions (rarer: a conversion needs a click).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from erase_tune.workloads import Task, Workload, WorkloadData
from erase_tune.workloads.base import prior_entropy

DIM = 16


class TwoTower(nn.Module):
    """Features (B, 16) -> [click probability (B,), conversion logit (B,)]."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.click = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Sigmoid())
        self.conversion = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: Tensor) -> list[Tensor]:
        h = self.bottom(x)
        return [self.click(h).squeeze(-1), self.conversion(h).squeeze(-1)]


def _model(hidden: int, seed: int) -> TwoTower:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TwoTower(hidden)


def batches(n: int, batch: int, seed: int, device: torch.device) -> list[tuple[tuple[Tensor], Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    click = torch.bernoulli(torch.sigmoid(2 * x[:, 0] - x[:, 1]), generator=g)
    conversion = click * torch.bernoulli(torch.sigmoid(x[:, 2] - 1.5), generator=g)
    labels = torch.stack([click, conversion], dim=1)  # (n, 2): one column per task
    return [((x[k : k + batch].to(device),), labels[k : k + batch].to(device)) for k in range(0, n, batch)]


def _data(device: torch.device, *, batch: int, steps: int, seed: int) -> WorkloadData:
    train = batches(batch * steps, batch, seed, device)
    held = batches(batch * 4, batch, seed + 1, device)
    clicks = torch.cat([t[:, 0] for _, t in train])
    return WorkloadData(train=train, eval=held, prior_entropy=prior_entropy(clicks))


TASKS = (
    Task(name="click", output=lambda out: out[0], loss_fn=nn.functional.binary_cross_entropy, label=0),
    Task(name="conversion", output=lambda out: out[1], loss_fn=nn.functional.binary_cross_entropy_with_logits,
         label=1, weight=2.0),
)


def workload(*, batch: int = 64, hidden: int = 32, steps: int = 64, lr: float = 1e-2, seed: int = 0,
             main_task: str = "click") -> Workload:
    """The two-task workload (``main_task``: the task whose NE gap a study judges)."""
    return Workload(
        name="tests.multitask:workload",
        args={"batch": batch, "hidden": hidden, "steps": steps, "lr": lr, "seed": seed, "main_task": main_task},
        build_model=functools.partial(_model, hidden, seed),
        tasks=TASKS,
        main_task=main_task,
        make_data=functools.partial(_data, batch=batch, steps=steps, seed=seed),
        make_example=lambda device: batches(batch, batch, seed, device)[0],
        cut_candidates=("bottom", "click.0", "conversion.0"),
        batch_size=batch,
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
    )
