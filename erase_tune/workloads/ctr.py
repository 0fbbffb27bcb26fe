"""CTR proxy: a DLRM-style ranking model with six dense subarchitectures, and its data.

This is the workload of the paper's headline experiment: a click-through-rate model whose
six dense subarchitectures are the natural cut points (each is detached, given a local loss,
and its backward launched early). The model is split into named parts the way torchrec's
``models/dlrm.py`` is (``sparse``, ``dense``, ``interaction``, ``subarchs``, ``over``), so a
cut names exactly one of them.

The synthetic data come from a planted teacher whose logit mixes a linear part, pairwise
latent interactions (what DLRM's dot-product interaction captures), 3-way crosses (what a
cross network captures) and a random nonlinear layer over all latents and dense features
(what only the deep towers capture). The interaction and the shallow over-arch cannot fit
the last parts, so freezing or detaching the subarchs costs measurable NE; otherwise
"detach everything" would be free and the tuning problem trivial. ``data=<path>`` trains
on a Criteo-format TSV instead.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.workloads import fused_if_cuda
from erase_tune.workloads.base import Batch, Workload, WorkloadData, builtin_workload, split_pools
from erase_tune.workloads.criteo import NUM_DENSE, check_criteo_data, load_criteo_batch, load_criteo_split
from erase_tune.workloads.limits import TRAINING_BYTES_PER_PARAMETER, Need, check_arg, check_ints, click_pool_needs

__all__ = [
    "SparseArch",
    "DenseArch",
    "InteractionArch",
    "MLPTower",
    "CrossNet",
    "AttentionArch",
    "OverArch",
    "CTRModel",
    "synthetic_ctr",
    "workload",
]

# Teacher constants. They are fixed (not workload args) so that a workload name plus its
# args pins the data down. Tuned so that towers trained for 400 steps beat towers frozen at
# init: by 0.07-0.11 held-out NE over seeds 0-3 on CPU at test sizes (8 tables of 20 rows,
# batch 256), and 0.686 vs 0.756 on an H200 at batch 8192, width 256, emb_dim 64, 1e5 rows
# (one epoch of 400 batches). With the ridge part a random tanh MLP of many units, or with
# the raw dense features fed to it, the frozen model matched the trained one (the
# interaction and the over-arch could fit those).
_LATENT_DIM = 4
"""Per-category hidden vector; small, so that embeddings can recover it from few clicks."""
_RIDGE_UNITS = 4
"""Units of the teacher's random |·| layer. Few and strong: a noisy click label carries
little information, so a part with many units would be learnable by nobody in a short run."""
_NUM_TRIPLES = 24
"""Random 3-way crosses among the fields (what a cross network models)."""
_ZIPF_EXPONENT = 1.05
"""Category popularity, heavy-headed like real CTR ids."""
_INFORMATIVE_IDS = 64
"""Ids per table, by popularity, whose click effect can be learned; rarer ids have none."""
_TARGET_BAYES_NE = 0.6
"""NE of the true click probabilities; the logit scale is bisected to hit it."""
_MIX = {"linear": 0.15, "pairwise": 0.15, "cross3": 0.1, "ridge": 0.6}
"""Share of the teacher logit's variance per component (the shares sum to 1)."""
_CALIBRATION_EXAMPLES = 65536
"""Examples used to set the logit scale and bias (enough for 3 decimals, cheap at any size)."""


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


class SparseArch(nn.Module):
    """One sum-pooled embedding bag per categorical feature.

    Input ``sparse``: (B, T, bag) int64 ids in ``[0, rows)``. Output: (B, T, E).
    """

    def __init__(self, *, num_tables: int, rows: int, emb_dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, emb_dim, mode="sum") for _ in range(num_tables))
        # DLRM's uniform(±1/sqrt(rows)) makes every interaction ~0 at large row counts;
        # a fixed small scale keeps the dot products informative from step one.
        for table in self.tables:
            nn.init.uniform_(table.weight, -0.05, 0.05)

    def forward(self, sparse: Tensor) -> Tensor:
        return torch.stack([table(sparse[:, t]) for t, table in enumerate(self.tables)], dim=1)


class DenseArch(nn.Module):
    """Bottom MLP over the dense features: (B, 13) → (B, E)."""

    def __init__(self, *, width: int, emb_dim: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(NUM_DENSE, width), nn.ReLU(), nn.Linear(width, emb_dim))

    def forward(self, dense: Tensor) -> Tensor:
        return self.model(dense)


class InteractionArch(nn.Module):
    """DLRM pairwise dot products among the dense vector and the T embeddings.

    Inputs ``dense`` (B, E) and ``sparse`` (B, T, E). Output: (B, (T+1)·T/2). It has no
    parameters, so the embeddings keep learning from the main loss even when every
    subarchitecture is detached.
    """

    def __init__(self, *, num_tables: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_tables + 1, num_tables + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return gram[:, self.rows, self.cols]


class MLPTower(nn.Module):
    """A deep tower: ``depth`` hidden layers then a projection. (B, D) → (B, out)."""

    def __init__(
        self, *, in_dim: int, width: int, depth: int, out_dim: int, act: type[nn.Module], norm: bool = False
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(depth):
            layers.append(nn.Linear(dim, width))
            if norm:
                layers.append(nn.LayerNorm(width))
            layers.append(act())
            dim = width
        layers.append(nn.Linear(dim, out_dim))
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class CrossNet(nn.Module):
    """DCN-v2 low-rank cross network plus a projection. (B, D) → (B, out).

    Layer ``l``: ``x_{l+1} = x_0 * (V_l U_l x_l + b_l) + x_l``; ``depth`` layers give
    feature crosses up to degree ``depth + 1``.
    """

    def __init__(self, *, in_dim: int, depth: int, rank: int, out_dim: int) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(in_dim, rank, bias=False) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(rank, in_dim) for _ in range(depth))
        self.proj = nn.Linear(in_dim, out_dim)

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return self.proj(x)


class AttentionArch(nn.Module):
    """One self-attention layer over the T+1 feature vectors, mean-pooled and projected.

    Input: the flat subarch input (B, (T+1)·E), viewed as (B, T+1, E). Output: (B, out).
    It takes the flat tensor so that every subarch has the same one-tensor signature.
    """

    def __init__(self, *, num_vectors: int, emb_dim: int, out_dim: int) -> None:
        super().__init__()
        heads = next(h for h in (4, 2, 1) if emb_dim % h == 0)
        self.num_vectors, self.emb_dim = num_vectors, emb_dim
        self.attn = nn.MultiheadAttention(emb_dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(emb_dim)
        self.proj = nn.Linear(emb_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        v = x.view(x.shape[0], self.num_vectors, self.emb_dim)
        attended, _ = self.attn(v, v, v, need_weights=False)
        return self.proj(self.norm(v + attended).mean(dim=1))


class OverArch(nn.Module):
    """Top MLP: (B, D) → logits (B,). Kept to one hidden layer on purpose: a deep over-arch
    could learn on its own what the subarchitectures are there to learn."""

    def __init__(self, *, in_dim: int, width: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(in_dim, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).squeeze(-1)


class CTRModel(nn.Module):
    """DLRM-style CTR model with six dense subarchitectures (the cut candidates).

    ``forward(dense (B, 13) float, sparse (B, T, bag) int64) -> logits (B,)``.
    Every subarch reads the same (B, (T+1)·E) tensor ``cat(dense vector, embeddings)``,
    built here, and returns (B, sub_out): one tensor in, one out, so a cut can detach
    both ends.
    """

    def __init__(
        self, *, num_tables: int, rows: int, emb_dim: int, width: int, depth: int, sub_out: int
    ) -> None:
        super().__init__()
        feat_dim = (num_tables + 1) * emb_dim
        self.sparse = SparseArch(num_tables=num_tables, rows=rows, emb_dim=emb_dim)
        self.dense = DenseArch(width=width, emb_dim=emb_dim)
        self.interaction = InteractionArch(num_tables=num_tables)
        tower = functools.partial(MLPTower, in_dim=feat_dim, depth=depth, out_dim=sub_out)
        self.subarchs = nn.ModuleList(
            [
                # Four towers that differ a little, as production subarchs do.
                tower(width=width, act=nn.ReLU),
                tower(width=width, act=nn.GELU),
                tower(width=2 * width, act=nn.SiLU),
                tower(width=width, act=nn.ReLU, norm=True),
                CrossNet(in_dim=feat_dim, depth=depth, rank=max(1, width // 2), out_dim=sub_out),
                AttentionArch(num_vectors=num_tables + 1, emb_dim=emb_dim, out_dim=sub_out),
            ]
        )
        num_pairs = (num_tables + 1) * num_tables // 2
        self.over = OverArch(in_dim=emb_dim + num_pairs + len(self.subarchs) * sub_out, width=width)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        dense_vec = self.dense(dense)
        embedded = self.sparse(sparse)
        pairs = self.interaction(dense_vec, embedded)
        features = torch.cat([dense_vec, embedded.flatten(1)], dim=1)
        subs = [arch(features) for arch in self.subarchs]
        return self.over(torch.cat([dense_vec, pairs, *subs], dim=1))


# ---------------------------------------------------------------------------------------
# Synthetic data: a planted teacher
# ---------------------------------------------------------------------------------------


def _standardize(x: Tensor) -> Tensor:
    # One value has no spread (std() would be NaN, and the labels' probabilities with it).
    std = x.std().clamp_min(1e-6) if x.numel() > 1 else x.new_ones(())
    return (x - x.mean()) / std


def _binary_entropy(p: Tensor) -> Tensor:
    p = p.clamp(1e-7, 1 - 1e-7)
    return -(p * p.log() + (1 - p) * (1 - p).log())


def _bias_for_rate(z: Tensor, rate: float, iters: int = 60) -> Tensor:
    """The bias b with mean(sigmoid(z + b)) == rate, by ``iters`` steps of bisection.

    On an accelerator it stays on the device (no sync). On the CPU, where a comparison costs no
    sync, it stops once a step left both ends unchanged: every later step would repeat it (the
    same midpoint, the same test), so the result is bit-identical to all ``iters`` steps, at about
    half the cost (float32 runs out of midpoints after some 30 of the 60 steps)."""
    lo = torch.full((), -40.0, device=z.device)
    hi = torch.full((), 40.0, device=z.device)
    on_host = z.device.type == "cpu"
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_high = torch.sigmoid(z + mid).mean() > rate
        new_lo, new_hi = torch.where(too_high, lo, mid), torch.where(too_high, mid, hi)
        if on_host and bool(new_lo == lo) and bool(new_hi == hi):
            break
        lo, hi = new_lo, new_hi
    return (lo + hi) / 2


def _bayes_ne(z: Tensor, rate: float) -> Tensor:
    p = torch.sigmoid(z + _bias_for_rate(z, rate))
    return _binary_entropy(p).mean() / _binary_entropy(torch.tensor(rate, device=z.device))


def _teacher_logits(dense: Tensor, ranks: Tensor, *, gen: torch.Generator) -> Tensor:
    """Unscaled teacher logit (zero mean, unit variance) per example.

    ``dense`` (N, 13) float, ``ranks`` (N, T, bag) int64 popularity ranks of the ids → (N,).
    Only the ``_INFORMATIVE_IDS`` most popular ids of a table carry a latent; the tail shares
    a zero one. So the teacher has a bounded number of unknowns whatever ``rows`` is, and a
    run of a few epochs can learn it instead of memorising label noise through rare ids.
    The fields are the T per-category latents (k-dim, sum-pooled over the bag) plus a k-dim
    projection of the dense features. Components, each standardised and weighted by ``_MIX``:

    - ``linear``: a scalar per category plus a linear function of the dense features;
    - ``pairwise``: all field-pair dot products (what DLRM's interaction models);
    - ``cross3``: a few random 3-way elementwise crosses (what a cross network models);
    - ``ridge``: ``Σ_h v_h·|a_h·fields|`` with distinct random directions ``a_h``. Each unit
      needs its own linear view of every field and the |·| has no linear or bilinear part,
      so neither the dot-product interaction nor a shallow over-arch can fit it: this is
      the part that only trained towers capture.
    """
    device = dense.device
    n, num_tables, bag = ranks.shape
    k, num_fields = _LATENT_DIM, num_tables + 1
    # Draw every teacher parameter first, in a fixed order: the teacher depends on the seed only.
    # Row _INFORMATIVE_IDS of each table is the tail's shared (zero) entry.
    latent = torch.randn(num_tables, _INFORMATIVE_IDS + 1, k, generator=gen, device=device)
    cat_weight = torch.randn(num_tables, _INFORMATIVE_IDS + 1, generator=gen, device=device)
    latent[:, -1], cat_weight[:, -1] = 0.0, 0.0
    dense_weight = torch.randn(NUM_DENSE, generator=gen, device=device)
    dense_latent = torch.randn(NUM_DENSE, k, generator=gen, device=device) / math.sqrt(NUM_DENSE)
    ridge_in = torch.randn(num_fields * k, _RIDGE_UNITS, generator=gen, device=device)
    ridge_out = torch.randn(_RIDGE_UNITS, generator=gen, device=device)
    triples = torch.randint(0, num_fields, (_NUM_TRIPLES, 3), generator=gen, device=device)

    table = torch.arange(num_tables, device=device).view(1, num_tables, 1)
    row = ranks.clamp_max(_INFORMATIVE_IDS)
    # Sum pooling over the bag, scaled so that the bag size leaves the variance unchanged.
    z = latent[table, row].sum(dim=2) / math.sqrt(bag)  # (N, T, k)
    fields = torch.cat([(dense @ dense_latent).unsqueeze(1), z], dim=1)  # (N, T+1, k)
    total = fields.sum(dim=1)
    parts = {
        "linear": cat_weight[table, row].sum(dim=(1, 2)) / math.sqrt(bag) + dense @ dense_weight,
        "pairwise": 0.5 * ((total * total).sum(-1) - (fields * fields).sum(dim=(1, 2))),
        "cross3": (fields[:, triples[:, 0]] * fields[:, triples[:, 1]] * fields[:, triples[:, 2]]).sum(dim=(1, 2)),
        "ridge": (fields.flatten(1) @ ridge_in).abs() @ ridge_out,
    }
    return _standardize(sum(math.sqrt(_MIX[name]) * _standardize(part) for name, part in parts.items()))


def synthetic_ctr(
    n: int, *, num_tables: int, rows: int, bag: int, base_rate: float, seed: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` examples from the planted teacher: dense (n, 13), sparse (n, T, bag), labels (n,).

    Deterministic for a given seed and device; generated on ``device`` in one vectorised
    pass (nothing is O(rows²), so GPU sizes with 10⁵ rows per table build in well under a
    second). The logit scale is set by bisection so that the Bayes-optimal NE is about
    ``_TARGET_BAYES_NE`` and the bias so that the mean click probability is ``base_rate``.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    dense = torch.randn(n, NUM_DENSE, generator=gen, device=device)
    cdf = torch.cumsum(torch.arange(1, rows + 1, device=device, dtype=torch.float64).pow(-_ZIPF_EXPONENT), 0)
    cdf = (cdf / cdf[-1]).float()
    u = torch.rand(n, num_tables, bag, generator=gen, device=device)
    ranks = torch.searchsorted(cdf, u.flatten()).clamp_max(rows - 1).view(n, num_tables, bag)
    # Shuffle popularity per table so that id 0 is not the head of every table.
    perms = torch.argsort(torch.rand(num_tables, rows, generator=gen, device=device), dim=1)
    sparse = torch.gather(perms, 1, ranks.permute(1, 0, 2).reshape(num_tables, -1))
    sparse = sparse.view(num_tables, n, bag).permute(1, 0, 2).contiguous()
    z = _teacher_logits(dense, ranks, gen=gen)
    calib = z[:_CALIBRATION_EXAMPLES]
    lo = torch.zeros((), device=device)
    hi = torch.full((), 20.0, device=device)
    for _ in range(30):  # the Bayes NE falls as the logit scale grows
        mid = (lo + hi) / 2
        sharp = _bayes_ne(mid * calib, base_rate) < _TARGET_BAYES_NE
        hi = torch.where(sharp, mid, hi)
        lo = torch.where(sharp, lo, mid)
    scale = (lo + hi) / 2
    logits = scale * z + _bias_for_rate(scale * calib, base_rate)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
    return dense, sparse, labels


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def _batches(dense: Tensor, sparse: Tensor, labels: Tensor, batch: int) -> list[Batch]:
    return [
        ((dense[i : i + batch], sparse[i : i + batch]), labels[i : i + batch]) for i in range(0, len(labels), batch)
    ]


_DATA_ARGS = ("num_tables", "rows", "bag", "base_rate", "seed")
"""The workload arguments :func:`synthetic_ctr` takes."""
_MODEL_ARGS = ("num_tables", "rows", "emb_dim", "width", "depth", "sub_out")
"""The workload arguments :class:`CTRModel` takes."""


def _synthetic(n: int, args: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` examples from the planted teacher, as the workload's ``args`` configure it (one
    place for the train/eval pools and the example batch to ask for them)."""
    return synthetic_ctr(n, **{k: args[k] for k in _DATA_ARGS}, device=torch.device(device))


def _synthetic_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    batch, n_train = args["batch"], args["train_batches"] * args["batch"]
    dense, sparse, labels = _synthetic(n_train + args["eval_batches"] * batch, args, device)
    return split_pools(_batches, (dense, sparse, labels), slice(0, n_train), slice(n_train, None), batch)


def _criteo_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    """Train pool and held-out split from a Criteo TSV (split by ``load_criteo_split``)."""
    batch = args["batch"]
    (dense, sparse, labels), train, held = load_criteo_split(
        args["data"], rows=args["rows"], batch=batch, train_batches=args["train_batches"],
        eval_batches=args["eval_batches"], workload="ctr")
    device = torch.device(device)
    dense, sparse, labels = dense.to(device), sparse.to(device), labels.to(device)
    return split_pools(_batches, (dense, sparse, labels), train, held, batch)


def _build_model(*, args: dict[str, Any]) -> CTRModel:
    # fork_rng: seed the initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        return CTRModel(**{k: args[k] for k in _MODEL_ARGS})


def _synthetic_example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """One batch straight from the teacher: no pool, so it costs one batch (plus the
    per-table id order) whatever ``train_batches`` is."""
    dense, sparse, labels = _synthetic(args["batch"], args, device)
    return (dense, sparse), labels


def _criteo_example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """The file's first ``batch`` lines: the first training batch ``make_data`` gives."""
    batch = args["batch"]
    dense, sparse, labels = load_criteo_batch(args["data"], rows=args["rows"], batch=batch, workload="ctr")
    device = torch.device(device)
    return (dense.to(device), sparse.to(device)), labels.to(device)


_INTS = ("batch", "width", "depth", "emb_dim", "num_tables", "rows", "bag", "sub_out", "train_batches",
         "eval_batches", "seed")
"""The integer arguments, checked in this order (bounds: ``limits.INT_BOUNDS`` and :data:`_BOUNDS`)."""
_BOUNDS = {"depth": (1, 64), "bag": (1, 1024), "sub_out": (1, 2**16)}
"""Bounds on this workload's own integer arguments: far above any real run, low enough that no
argument can make the factory hang."""


def _parameter_count(args: dict[str, Any]) -> tuple[int, int]:
    """Parameters of :class:`CTRModel` for ``args``: (embedding tables, everything else),
    counted, not built (see ``limits``)."""
    t, rows, e = args["num_tables"], args["rows"], args["emb_dim"]
    width, depth, out = args["width"], args["depth"], args["sub_out"]
    feat = (t + 1) * e
    linear = lambda i, o, bias=True: i * o + (o if bias else 0)  # noqa: E731

    def tower(w: int, norm: bool) -> int:
        hidden = linear(feat, w) + (depth - 1) * linear(w, w) + (2 * w * depth if norm else 0)
        return hidden + linear(w, out)

    rank = max(1, width // 2)
    subarchs = (
        2 * tower(width, False) + tower(2 * width, False) + tower(width, True)
        + depth * (linear(feat, rank, bias=False) + linear(rank, feat)) + linear(feat, out)  # cross network
        + linear(e, 3 * e) + linear(e, e) + 2 * e + linear(e, out)  # attention, its norm, projection
    )  # fmt: skip
    dense_arch = linear(NUM_DENSE, width) + linear(width, e)
    over = linear(e + (t + 1) * t // 2 + 6 * out, width) + linear(width, 1)
    return t * rows * e, dense_arch + subarchs + over


def _needs(args: dict[str, Any]) -> list[Need]:
    """What the model (trained with Adam) and the data pools need, from the arguments alone."""
    tables, dense = _parameter_count(args)
    t, rows, e = args["num_tables"], args["rows"], args["emb_dim"]
    return [
        Need(
            "the embedding tables", tables * TRAINING_BYTES_PER_PARAMETER, f"num_tables={t} x rows={rows} x emb_dim={e}"
        ),
        Need(
            "the dense layers",
            dense * TRAINING_BYTES_PER_PARAMETER,
            f"width={args['width']}, depth={args['depth']}, num_tables={t}, emb_dim={e}, sub_out={args['sub_out']}",
        ),
        *click_pool_needs(args, bag=args["bag"]),
    ]



# wide: the workload's user-facing arguments (--arg key=value)
def workload(
    *,
    batch: int = 256,
    width: int = 64,
    depth: int = 3,
    emb_dim: int = 16,
    num_tables: int = 26,
    rows: int = 1000,
    bag: int = 1,
    sub_out: int = 32,
    train_batches: int = 32,
    eval_batches: int = 8,
    base_rate: float = 0.25,
    lr: float = 1e-3,
    data: str | os.PathLike[str] = "synthetic",
    seed: int = 0,
) -> Workload:
    """The CTR proxy. Defaults are small enough for a CPU; GPU trials use e.g.
    ``batch=8192, width=256, emb_dim=64, rows=100000``.

    Give a run at least as many ``train_batches`` as steps. Like real CTR models (the
    "one-epoch phenomenon"), this one overfits sharply once it sees examples again: on an
    H200 at the sizes above, held-out NE went 0.83 → 2.7 over 400 steps on a pool of 100
    batches, against 0.83 → 0.69 on a pool of 400. A pool of 400 such batches is ~0.9 GB.

    ``data`` is ``"synthetic"`` (the planted teacher) or a path to a Criteo-format TSV
    (then ``num_tables`` must be 26 and ``bag`` 1, as in the file format).
    """
    data = os.fspath(data)  # provenance records a plain string
    args = dict(locals())
    check_ints("ctr", args, _INTS, _BOUNDS)
    check_arg("ctr", "base_rate", base_rate, 0.0 < base_rate < 1.0, "a number strictly between 0 and 1")
    check_arg("ctr", "lr", lr, lr > 0 and math.isfinite(lr), "a finite number > 0")
    if data == "synthetic":
        make_data, make_example = _synthetic_data, _synthetic_example
    else:
        check_criteo_data("ctr", data, num_tables)
        check_arg("ctr", "bag", bag, bag == 1, "1 with Criteo data")
        make_data, make_example = _criteo_data, _criteo_example
    return builtin_workload("ctr", args, _needs, build_model=_build_model, make_data=make_data,
                            make_example=make_example, loss_fn=F.binary_cross_entropy_with_logits,
                            make_head=_make_head, cut_candidates=tuple(f"subarchs.{i}" for i in range(6)),
                            optimizer=functools.partial(fused_if_cuda, torch.optim.Adam, lr=lr))


class _LogitHead(nn.Module):
    """Aux head for a subarch cut: (B, sub_out) → logits (B,), the shape the loss expects."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).squeeze(-1)


def _make_head(cut_name: str, cut_output: Tensor, model_output: Tensor) -> nn.Module:
    return _LogitHead(cut_output.shape[-1]).to(cut_output.device)
