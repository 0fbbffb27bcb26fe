"""DLRM: the public reference recommendation model, as a user brings it, and its data.

This is the layout of facebookresearch/dlrm (``dlrm_s_pytorch.py``) and of MLPerf's DLRM
benchmark, kept close enough that what erase-tune finds on it carries over to the model users
actually train: a bottom MLP ``bot_l`` over the 13 dense features, one sum-pooled
``EmbeddingBag`` per categorical feature in ``emb_l`` (sparse gradients), the dot
interaction, a top MLP ``top_l`` ending in a Sigmoid, ``BCELoss`` and plain SGD.

The interaction is written the way the reference writes it: the strict lower triangle of the
Gram matrix is gathered with index tensors ``li``/``lj`` that ``torch.tensor`` builds on the
host in every forward. Indexing a CUDA tensor with them copies them to the device during the
step, so the whole step can never be captured as one CUDA graph. That is the point of this
workload: it is a host-bound model (about 70 torch calls in one forward at 26 tables) on
which only *parts* of the step can be graphed, and a search must live with that.

The forward takes the reference's inputs ``(dense_x, lS_o, lS_i)``: dense features (B, 13),
per-table offsets (T, B) and per-table ids (T, B), one id per example and table, as in the
Criteo layout. Data are the ``ctr`` workload's planted teacher (``ctr.synthetic_ctr``), whose
dense part feeds nonlinear terms only trained MLPs fit, or a Criteo-format TSV (``data=``).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError, shown
from erase_tune.workloads.base import Batch, Workload, WorkloadData, builtin_workload, split_pools
from erase_tune.workloads.criteo import NUM_DENSE, check_criteo_data, load_criteo_batch, load_criteo_split
from erase_tune.workloads.ctr import synthetic_ctr
from erase_tune.workloads.limits import Need, check_arg, check_ints, click_pool_needs

__all__ = ["DLRM_Net", "parse_mlp", "workload"]

_BASE_RATE = 0.25
"""Click rate of the synthetic data (about Criteo's)."""
_MAX_LAYERS = 64
"""Most layers in one MLP argument."""
_MAX_WIDTH = 2**16
"""Widest layer an MLP argument may ask for."""
# Plain SGD keeps no state: a dense parameter costs its float32 weight and gradient; an
# embedding row costs its weight only, its gradient being sparse (the rows a batch touches:
# values and int64 ids, and a coalesced copy of both when SGD applies them).
_DENSE_BYTES_PER_PARAMETER = 8
_TABLE_BYTES_PER_PARAMETER = 4
_SPARSE_GRAD_COPIES = 2


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def _mlp(sizes: list[int], sigmoid_last: bool) -> nn.Sequential:
    """The reference's ``create_mlp``: Linear then ReLU per layer (Sigmoid after the last one
    of the top MLP), weights ~ N(0, 2/(fan_in + fan_out)), biases ~ N(0, 1/fan_out)."""
    layers: list[nn.Module] = []
    for i, (n, m) in enumerate(zip(sizes, sizes[1:])):
        linear = nn.Linear(n, m, bias=True)
        nn.init.normal_(linear.weight, 0.0, math.sqrt(2.0 / (m + n)))
        nn.init.normal_(linear.bias, 0.0, math.sqrt(1.0 / m))
        layers.append(linear)
        layers.append(nn.Sigmoid() if sigmoid_last and i == len(sizes) - 2 else nn.ReLU())
    return nn.Sequential(*layers)


class DLRM_Net(nn.Module):  # noqa: N801 (the reference implementation's name, as users know it)
    """``forward(dense_x (B, 13), lS_o (T, B) int64, lS_i (T, B) int64) -> click probability (B,)``.

    ``bot`` and ``top`` are the MLPs' layer sizes after their inputs: ``bot[-1]`` is the
    embedding dimension, ``top[-1]`` is 1 (the top MLP's input, the dense vector and the
    interactions, is sized here).
    """

    def __init__(self, *, num_tables: int, rows: int, emb_dim: int, bot: list[int], top: list[int]) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList()
        for _ in range(num_tables):
            table = nn.EmbeddingBag(rows, emb_dim, mode="sum", sparse=True)
            bound = math.sqrt(1.0 / rows)
            nn.init.uniform_(table.weight, -bound, bound)
            self.emb_l.append(table)
        self.bot_l = _mlp([NUM_DENSE, *bot], sigmoid_last=False)
        num_pairs = (num_tables + 1) * num_tables // 2
        self.top_l = _mlp([emb_dim + num_pairs, *top], sigmoid_last=True)

    def apply_emb(self, lS_o: Tensor, lS_i: Tensor) -> list[Tensor]:
        return [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(self.emb_l)]

    def interact_features(self, x: Tensor, ly: list[Tensor]) -> Tensor:
        batch_size, d = x.shape
        T = torch.cat([x, *ly], dim=1).view(batch_size, -1, d)
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        # As the reference does it: host index tensors, built anew in every forward (their
        # copy to the device is what keeps the whole step out of one CUDA graph).
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        Zflat = Z[:, li, lj]
        return torch.cat([x, Zflat], dim=1)

    def forward(self, dense_x: Tensor, lS_o: Tensor, lS_i: Tensor) -> Tensor:
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_o, lS_i)
        z = self.interact_features(x, ly)
        return self.top_l(z).squeeze(-1)


def parse_mlp(text: Any, name: str) -> list[int]:
    """Layer sizes from ``"512-256-128"``; :class:`WorkloadError` (one line) naming ``name``."""
    need = f"layer sizes like '512-256-128' (at most {_MAX_LAYERS} layers of 1..{_MAX_WIDTH})"
    if not isinstance(text, str) or len(text) > _MAX_LAYERS * 7:
        raise WorkloadError(f"workload 'dlrm': argument {name!r} must be {need}, got {shown(text)}")
    parts = text.split("-")
    if len(parts) > _MAX_LAYERS or not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):
        raise WorkloadError(f"workload 'dlrm': argument {name!r} must be {need}, got {shown(text)}")
    sizes = [int(p) for p in parts]
    if not all(1 <= s <= _MAX_WIDTH for s in sizes):
        raise WorkloadError(f"workload 'dlrm': argument {name!r} must be {need}, got {shown(text)}")
    return sizes


# ---------------------------------------------------------------------------------------
# Data: the reference's input layout
# ---------------------------------------------------------------------------------------


def _batches(dense: Tensor, ids: Tensor, labels: Tensor, batch: int) -> list[Batch]:
    """Batches ``((dense_x, lS_o, lS_i), labels)`` from dense (N, 13), ids (N, T), labels (N,)."""
    out = []
    offsets: dict[int, Tensor] = {}
    for i in range(0, len(labels), batch):
        b = min(batch, len(labels) - i)
        if b not in offsets:  # one id per example and table: offset j is example j, in every table
            offsets[b] = torch.arange(b, device=ids.device).expand(ids.shape[1], b).contiguous()
        out.append(((dense[i : i + b], offsets[b], ids[i : i + b].t().contiguous()), labels[i : i + b]))
    return out


def _synthetic(n: int, args: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    dense, sparse, labels = synthetic_ctr(
        n, num_tables=args["num_tables"], rows=args["rows"], bag=1, base_rate=_BASE_RATE, seed=args["seed"],
        device=torch.device(device),
    )  # fmt: skip
    return dense, sparse[:, :, 0], labels


def _synthetic_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    batch, n_train = args["batch"], args["train_batches"] * args["batch"]
    dense, ids, labels = _synthetic(n_train + args["eval_batches"] * batch, args, device)
    return split_pools(_batches, (dense, ids, labels), slice(0, n_train), slice(n_train, None), batch)


def _synthetic_example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """One batch straight from the teacher (no pool)."""
    dense, ids, labels = _synthetic(args["batch"], args, device)
    return _batches(dense, ids, labels, args["batch"])[0]


def _criteo_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    """Train pool and held-out split from a Criteo TSV, split as the ``ctr`` workload splits
    it: the last lines read are held out; the train pool keeps full batches only."""
    batch = args["batch"]
    (dense, sparse, labels), train, held = load_criteo_split(
        args["data"], rows=args["rows"], batch=batch, train_batches=args["train_batches"],
        eval_batches=args["eval_batches"], workload="dlrm")
    device = torch.device(device)
    dense, ids, labels = dense.to(device), sparse[:, :, 0].to(device), labels.to(device)
    return split_pools(_batches, (dense, ids, labels), train, held, batch)


def _criteo_example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """The file's first ``batch`` lines: the first training batch ``make_data`` gives."""
    batch = args["batch"]
    dense, sparse, labels = load_criteo_batch(args["data"], rows=args["rows"], batch=batch, workload="dlrm")
    device = torch.device(device)
    return _batches(dense.to(device), sparse[:, :, 0].to(device), labels.to(device), batch)[0]


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def _build_model(*, args: dict[str, Any]) -> DLRM_Net:
    # fork_rng: seed the initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        return DLRM_Net(num_tables=args["num_tables"], rows=args["rows"], emb_dim=args["emb_dim"],
                        bot=parse_mlp(args["bot_mlp"], "bot_mlp"), top=parse_mlp(args["top_mlp"], "top_mlp"))


def _parameter_count(args: dict[str, Any]) -> tuple[int, int]:
    """Parameters of :class:`DLRM_Net` for ``args``: (embedding tables, MLPs), counted, not built."""
    t, e = args["num_tables"], args["emb_dim"]
    bot, top = parse_mlp(args["bot_mlp"], "bot_mlp"), parse_mlp(args["top_mlp"], "top_mlp")
    mlp = lambda sizes: sum(n * m + m for n, m in zip(sizes, sizes[1:]))  # noqa: E731
    return t * args["rows"] * e, mlp([NUM_DENSE, *bot]) + mlp([e + (t + 1) * t // 2, *top])


def _needs(args: dict[str, Any]) -> list[Need]:
    """What the model (trained with plain SGD) and the data pools need, from the arguments alone."""
    tables, dense = _parameter_count(args)
    t, rows, e, batch = args["num_tables"], args["rows"], args["emb_dim"], args["batch"]
    return [
        Need("the embedding tables", tables * _TABLE_BYTES_PER_PARAMETER,
             f"num_tables={t} x rows={rows} x emb_dim={e}"),
        Need("the sparse gradients", _SPARSE_GRAD_COPIES * batch * t * (4 * e + 8),
             f"batch={batch} x num_tables={t} x emb_dim={e}"),
        Need("the MLPs", dense * _DENSE_BYTES_PER_PARAMETER,
             f"bot_mlp={args['bot_mlp']!r}, top_mlp={args['top_mlp']!r}, num_tables={t}, emb_dim={e}"),
        *click_pool_needs(args, bag=1),  # one id per table and example
    ]  # fmt: skip


def cut_candidates(bot: list[int], top: list[int]) -> tuple[str, ...]:
    """What a user would try, upstream first: the bottom MLP and its first layer (each can be
    detached: nothing upstream of them trains), the top MLP and its first two layers (they
    produce the output or detach the embeddings from it: placed or graphed, never detached)."""
    out = ["bot_l"]
    if len(bot) > 1:
        out.append("bot_l.0:2")
    out.append("top_l")
    if len(top) > 2:
        out.append("top_l.0:4")
    return tuple(out)


_INTS = ("batch", "rows", "emb_dim", "num_tables", "train_batches", "eval_batches", "seed")
"""The integer arguments, checked in this order (bounds: ``limits.INT_BOUNDS``)."""



# wide: the workload's user-facing arguments (--arg key=value)
def workload(
    *,
    batch: int = 4096,
    rows: int = 100_000,
    emb_dim: int = 128,
    num_tables: int = 26,
    bot_mlp: str = "512-256-128",
    top_mlp: str = "1024-1024-512-256-1",
    lr: float = 0.5,
    train_batches: int = 64,
    eval_batches: int = 8,
    data: str | os.PathLike[str] = "synthetic",
    seed: int = 0,
) -> Workload:
    """The reference DLRM. Defaults are MLPerf's shape on one GPU (26 tables of 100k rows,
    dim 128, bottom MLP 13-512-256-128, top 1024-1024-512-256-1, batch 4096); a CPU test
    uses e.g. ``batch=128, rows=50, emb_dim=4, num_tables=4, bot_mlp="16-4", top_mlp="16-1"``.

    ``bot_mlp`` lists the bottom MLP's layer sizes after the 13 dense features and must end
    in ``emb_dim``; ``top_mlp`` the top MLP's after its input and must end in 1. ``lr`` is
    SGD's (sparse gradients: the embedding rows a batch touches). Give a run at least as many
    ``train_batches`` as steps (CTR models overfit once they see examples again, see
    ``ctr``). ``data`` is ``"synthetic"`` (the planted teacher) or the path of a
    Criteo-format TSV (then ``num_tables`` must be 26).
    """
    data = os.fspath(data)  # provenance records a plain string
    args = dict(locals())
    check_ints("dlrm", args, _INTS)
    bot, top = parse_mlp(bot_mlp, "bot_mlp"), parse_mlp(top_mlp, "top_mlp")
    check_arg("dlrm", "bot_mlp", bot_mlp, bot[-1] == emb_dim,
              f"layer sizes ending in emb_dim={emb_dim} (the reference's rule)")
    check_arg("dlrm", "top_mlp", top_mlp, top[-1] == 1, "layer sizes ending in 1 (one click probability)")
    check_arg("dlrm", "lr", lr, lr > 0 and math.isfinite(lr), "a finite number > 0")
    if data == "synthetic":
        make_data, make_example = _synthetic_data, _synthetic_example
    else:
        check_criteo_data("dlrm", data, num_tables)
        make_data, make_example = _criteo_data, _criteo_example
    # BCELoss, mean over the batch; plain SGD, as the reference: it takes the tables' sparse gradients as they are.
    return builtin_workload("dlrm", args, _needs, build_model=_build_model, make_data=make_data,
                            make_example=make_example, loss_fn=F.binary_cross_entropy,
                            cut_candidates=cut_candidates(bot, top),
                            optimizer=functools.partial(torch.optim.SGD, lr=lr))
