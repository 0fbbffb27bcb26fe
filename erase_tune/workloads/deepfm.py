"""DeepFM: a CTR model whose three branches share one embedding, and its synthetic clicks.

This is pytorch-fm's ``DeepFactorizationMachineModel``, kept close enough that a plan found
on it carries over to the DeepFM users train. It exists as a built-in for its shape: one
input (the shared embedding) feeding sibling branches whose outputs are summed, the shape
of DeepFM, Wide&Deep and DCN. A cut of one branch detaches the shared embedding from that
branch only, so whether a plan starves the embedding depends on which *other* branches
still train it. ``ctr``'s subarchitectures read one shared tensor too, but its embeddings
always keep a path to the loss that no plan cuts (the interaction); here the two branches
that train the embedding are both candidates, and one of them (``fm``) has no parameters.

Named parts (``ids`` (B, F) int64, one id per field in ``[0, rows)``; E = ``emb_dim``)::

    embedding  FeaturesEmbedding   ids (B, F)       -> (B, F, E)   one nn.Embedding over all
                                                                   fields' rows, per-field offsets
    linear     FeaturesLinear      ids (B, F)       -> (B, 1)      its own scalar table + bias
    fm         FactorizationMachine (B, F, E)       -> (B, 1)      2nd-order term, no parameters
    mlp        MultiLayerPerceptron (B, F·E)        -> (B, 1)      [Linear, BatchNorm1d, ReLU,
                                                                   Dropout] x len(hidden), Linear
    forward    ids (B, F) -> linear + fm + mlp -> logits (B,)

Where it differs from pytorch-fm, and why:

- The model returns logits and trains with ``binary_cross_entropy_with_logits`` (pytorch-fm
  applies a sigmoid and uses ``BCELoss``): the same objective, numerically safer.
- The per-field offsets are a buffer. pytorch-fm builds them from a numpy array in every
  forward (``x.new_tensor(self.offsets)``), a host-to-device copy that no CUDA graph can
  hold; ``dlrm`` already covers a model like that, and here the pieces should be graphable.
- The linear term's table starts at zero. pytorch-fm leaves ``nn.Embedding``'s N(0, 1)
  there, which puts a logit of standard deviation √F on every example before training;
  in the few hundred steps of a trial the rare ids never recover from it.
- ``dropout`` defaults to 0.0, as pytorch-fm's examples use it. With dropout, a trial's
  baseline and candidate draw the same masks (each its own copy of one seed's random
  numbers), so a plan that changes no gradient still reads an NE gap of exactly 0.

The synthetic data are categorical only, as DeepFM's inputs are. Ids are drawn per field
from a Zipf-like popularity (a few head ids take most examples, as real CTR ids do), and
labels from a planted teacher whose logit mixes a first-order part (a weight per id: what
``linear`` fits), all pairwise dot products of per-id latent vectors (what ``fm`` fits, and
the MLP only slowly) and a negative |·| ridge over all latents (what the MLP fits and the
FM cannot within its dimensions; see :func:`synthetic_clicks`), at a base rate of 0.25. At
the CPU test's sizes the FM and the MLP both matter: trained without either, the model is
measurably worse held out (``tests/workloads/test_deepfm.py`` gives the numbers). At the
GPU space's sizes the MLP (400-400-400) also learns most of what the FM does: trained for
428 steps (one seed, batch 4096, 26 fields of 10,000 rows, on a CPU), held-out NE was 0.699,
0.700 without the FM and 0.798 without the MLP (the teacher's Bayes NE is 0.6).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError, shown
from erase_tune.workloads import fused_if_cuda
from erase_tune.workloads.base import Batch, Workload, WorkloadData, builtin_workload, split_pools
from erase_tune.workloads.ctr import _bias_for_rate, _binary_entropy, _standardize  # the same teacher arithmetic
from erase_tune.workloads.limits import (
    TRAINING_BYTES_PER_PARAMETER,
    Need,
    check_arg,
    check_ints,
    pool_need,
    popularity_need,
)

__all__ = [
    "FeaturesEmbedding",
    "FeaturesLinear",
    "FactorizationMachine",
    "MultiLayerPerceptron",
    "DeepFactorizationMachineModel",
    "CANDIDATES",
    "parse_hidden",
    "synthetic_clicks",
    "workload",
]

CANDIDATES = ("linear", "mlp", "fm")
"""The three branches, as a search space names them. Detaching any one leaves the others
training the shared embedding, so each may be detached; but ``fm`` has no parameters, and with
``mlp`` detached too nothing would train the embedding at all: the search's guard never offers
the second of the two once the first is detached (a space that lists no candidates of its own
gets these). Detaching ``fm`` trains nothing and only takes its gradient off the embedding,
which is why the shipped spaces give it its other modes only."""

# Teacher constants: fixed (not workload args), so that a workload name plus its args pins
# the data down. Chosen as ``ctr``'s are: few informative ids per field (a bounded number of
# unknowns, learnable in a few hundred steps whatever ``rows`` is) and a Bayes NE well below 1.
_BASE_RATE = 0.25
"""Click rate (about Criteo's)."""
_LATENT_DIM = 4
"""Per-id hidden vector of the teacher."""
_INFORMATIVE_IDS = 64
"""Ids per field, by popularity, that carry an effect; rarer ids share a zero one."""
_RIDGE_UNITS = 4
"""Units of the teacher's random |·| layer: few and strong, so a short run can learn them."""
_ZIPF_EXPONENT = 1.05
"""Id popularity, heavy-headed like real CTR ids."""
_TARGET_BAYES_NE = 0.6
"""NE of the true click probabilities; the logit scale is bisected to hit it."""
_MIX = {"linear": 0.3, "pairwise": 0.3, "ridge": 0.4}
"""Share of the teacher logit's variance per component (the shares sum to 1)."""
_CALIBRATION_EXAMPLES = 65536
"""Examples used to set the logit scale and bias (enough for 3 decimals, cheap at any size)."""

_MAX_LAYERS = 64
"""Most hidden layers in the ``mlp`` argument."""
_MAX_WIDTH = 2**16
"""Widest hidden layer the ``mlp`` argument may ask for."""


# ---------------------------------------------------------------------------------------
# Model: pytorch-fm's layers
# ---------------------------------------------------------------------------------------


def _offsets(field_dims: Sequence[int]) -> Tensor:
    """Start of each field's rows in the one table: (F,) int64, ``[0, d0, d0 + d1, ...]``."""
    return torch.tensor([0, *field_dims[:-1]], dtype=torch.long).cumsum(0)


class FeaturesEmbedding(nn.Module):
    """One ``nn.Embedding`` over the concatenated vocabularies of all fields.

    ``forward(ids (B, F) int64) -> (B, F, E)``: field f's id ``i`` is row ``offsets[f] + i``.
    """

    def __init__(self, field_dims: Sequence[int], embed_dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        # A buffer, not pytorch-fm's per-forward numpy copy: see the module docstring.
        self.register_buffer("offsets", _offsets(field_dims), persistent=False)
        nn.init.xavier_uniform_(self.embedding.weight.data)

    def forward(self, x: Tensor) -> Tensor:
        return self.embedding(x + self.offsets.unsqueeze(0))


class FeaturesLinear(nn.Module):
    """The first-order term: a scalar per id, in a table of its own, summed over fields, plus a bias.

    ``forward(ids (B, F) int64) -> (B, 1)``.
    """

    def __init__(self, field_dims: Sequence[int], output_dim: int = 1) -> None:
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), output_dim)
        self.bias = nn.Parameter(torch.zeros((output_dim,)))
        self.register_buffer("offsets", _offsets(field_dims), persistent=False)
        nn.init.zeros_(self.fc.weight)  # pytorch-fm: N(0, 1); see the module docstring

    def forward(self, x: Tensor) -> Tensor:
        return torch.sum(self.fc(x + self.offsets.unsqueeze(0)), dim=1) + self.bias


class FactorizationMachine(nn.Module):
    """The FM's 2nd-order term ``Σ_{i<j} <v_i, v_j>``, in O(F·E) as ½((Σv)² − Σv²).

    ``forward((B, F, E)) -> (B, 1)`` with ``reduce_sum``, else (B, E). No parameters.
    """

    def __init__(self, reduce_sum: bool = True) -> None:
        super().__init__()
        self.reduce_sum = reduce_sum

    def forward(self, x: Tensor) -> Tensor:
        square_of_sum = torch.sum(x, dim=1) ** 2
        sum_of_square = torch.sum(x**2, dim=1)
        ix = square_of_sum - sum_of_square
        if self.reduce_sum:
            ix = torch.sum(ix, dim=1, keepdim=True)
        return 0.5 * ix


class MultiLayerPerceptron(nn.Module):
    """``[Linear, BatchNorm1d, ReLU, Dropout]`` per hidden width, then ``Linear(·, 1)``.

    ``forward((B, input_dim)) -> (B, 1)`` (``(B, embed_dims[-1])`` without the output layer).
    The layers are ``self.mlp``, a ``Sequential``, as in pytorch-fm.
    """

    def __init__(self, input_dim: int, embed_dims: Sequence[int], dropout: float, output_layer: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for embed_dim in embed_dims:
            layers.append(nn.Linear(input_dim, embed_dim))
            layers.append(nn.BatchNorm1d(embed_dim))
            layers.append(nn.ReLU())
            layers.append(nn.Dropout(p=dropout))
            input_dim = embed_dim
        if output_layer:
            layers.append(nn.Linear(input_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class DeepFactorizationMachineModel(nn.Module):
    """DeepFM: ``forward(ids (B, F) int64) -> logits (B,)``; see the module docstring for the parts."""

    def __init__(self, field_dims: Sequence[int], embed_dim: int, mlp_dims: Sequence[int], dropout: float) -> None:
        super().__init__()
        self.linear = FeaturesLinear(field_dims)
        self.fm = FactorizationMachine(reduce_sum=True)
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.mlp = MultiLayerPerceptron(self.embed_output_dim, mlp_dims, dropout)

    def forward(self, x: Tensor) -> Tensor:
        embed_x = self.embedding(x)
        x = self.linear(x) + self.fm(embed_x) + self.mlp(embed_x.view(-1, self.embed_output_dim))
        return x.squeeze(1)


def parse_hidden(text: Any) -> list[int]:
    """Hidden widths from ``"400-400-400"``; a one-line :class:`WorkloadError` otherwise."""
    need = f"hidden widths like '400-400-400' (1 to {_MAX_LAYERS} layers of 1..{_MAX_WIDTH})"
    error = WorkloadError(f"workload 'deepfm': argument 'mlp' must be {need}, got {shown(text)}")
    if not isinstance(text, str) or len(text) > _MAX_LAYERS * 7:
        raise error
    parts = text.split("-")
    if len(parts) > _MAX_LAYERS or not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):
        raise error
    widths = [int(p) for p in parts]
    if not all(1 <= w <= _MAX_WIDTH for w in widths):
        raise error
    return widths


# ---------------------------------------------------------------------------------------
# Synthetic data: a planted teacher over categorical fields
# ---------------------------------------------------------------------------------------


def _scale_for_bayes_ne(z: Tensor, rate: float, iters: int = 30) -> Tensor:
    """The scale s at which the true probabilities sigmoid(s·z + b) have NE ``_TARGET_BAYES_NE``."""
    prior = _binary_entropy(torch.tensor(rate, device=z.device))
    lo, hi = torch.zeros((), device=z.device), torch.full((), 20.0, device=z.device)
    for _ in range(iters):  # the Bayes NE falls as the scale grows
        mid = (lo + hi) / 2
        ne = _binary_entropy(torch.sigmoid(mid * z + _bias_for_rate(mid * z, rate))).mean() / prior
        sharp = ne < _TARGET_BAYES_NE
        hi, lo = torch.where(sharp, mid, hi), torch.where(sharp, lo, mid)
    return (lo + hi) / 2


def synthetic_clicks(n: int, *, num_fields: int, rows: int, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``n`` examples from the planted teacher: ids (n, F) int64 in ``[0, rows)``, labels (n,) in {0, 1}.

    Deterministic for a given seed and device; the teacher's parameters are drawn first, so
    they depend on the seed alone. Teacher logit, each part standardised and weighted by
    ``_MIX`` (only the ``_INFORMATIVE_IDS`` most popular ids of a field carry a latent and a
    weight; the rest share zeros):

    - ``linear``: a weight per (field, id), summed over fields;
    - ``pairwise``: ``Σ_{f<g} <z_f, z_g>`` over the fields' k-dim latents (the FM's form);
    - ``ridge``: ``−Σ_h u_h·|a_h·concat(z)|`` with ``u_h > 0`` and random directions ``a_h``:
      clicks fall as an example strays from the typical along a few directions. ``linear``
      has no cross terms, and an FM's are those of ``½|Σ_f v_f|²``, a *positive* form of the
      summed embeddings: the cross terms of a negative square over F fields take it about
      F − 1 embedding dimensions per unit, more than it has. The MLP fits |·| with two ReLUs.
      (A ridge of random signs, tried first, was fitted by the FM about as well as by the MLP.)
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    k, informative = _LATENT_DIM, _INFORMATIVE_IDS
    latent = torch.randn(num_fields, informative + 1, k, generator=gen, device=device)
    weight = torch.randn(num_fields, informative + 1, generator=gen, device=device)
    latent[:, -1], weight[:, -1] = 0.0, 0.0  # the tail's shared entry
    ridge_in = torch.randn(num_fields * k, _RIDGE_UNITS, generator=gen, device=device)
    ridge_out = torch.randn(_RIDGE_UNITS, generator=gen, device=device).abs()

    cdf = torch.cumsum(torch.arange(1, rows + 1, device=device, dtype=torch.float64).pow(-_ZIPF_EXPONENT), 0)
    cdf = (cdf / cdf[-1]).float()
    # Shuffle popularity per field, so that id 0 is not the head of every field.
    perms = torch.argsort(torch.rand(num_fields, rows, generator=gen, device=device), dim=1)
    u = torch.rand(n, num_fields, generator=gen, device=device)
    ranks = torch.searchsorted(cdf, u.flatten()).clamp_max(rows - 1).view(n, num_fields)
    del u
    ids = torch.gather(perms, 1, ranks.t()).t().contiguous()
    del perms

    field = torch.arange(num_fields, device=device).view(1, num_fields)
    row = ranks.clamp_max(informative)
    del ranks
    z = latent[field, row]  # (n, F, k)
    total = z.sum(dim=1)
    parts = {
        "linear": weight[field, row].sum(dim=1),
        "pairwise": 0.5 * ((total * total).sum(-1) - (z * z).sum(dim=(1, 2))),
        "ridge": -((z.flatten(1) @ ridge_in).abs() @ ridge_out),
    }
    del z, total, row
    logit = _standardize(sum(math.sqrt(_MIX[name]) * _standardize(part) for name, part in parts.items()))
    calib = logit[:_CALIBRATION_EXAMPLES]
    scale = _scale_for_bayes_ne(calib, _BASE_RATE)
    logit = scale * logit + _bias_for_rate(scale * calib, _BASE_RATE)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    return ids, labels


def _batches(ids: Tensor, labels: Tensor, batch: int) -> list[Batch]:
    return [((ids[i : i + batch],), labels[i : i + batch]) for i in range(0, len(labels), batch)]


def _make_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    batch, n_train = args["batch"], args["train_batches"] * args["batch"]
    ids, labels = synthetic_clicks(n_train + args["eval_batches"] * batch, num_fields=args["num_fields"],
                                   rows=args["rows"], seed=args["seed"], device=torch.device(device))
    return split_pools(_batches, (ids, labels), slice(0, n_train), slice(n_train, None), batch)


def _make_example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """One batch straight from the teacher: no pool, so it costs one batch (plus the per-field
    id order) whatever ``train_batches`` is."""
    ids, labels = synthetic_clicks(args["batch"], num_fields=args["num_fields"], rows=args["rows"],
                                   seed=args["seed"], device=torch.device(device))
    return (ids,), labels


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def _build_model(*, args: dict[str, Any]) -> DeepFactorizationMachineModel:
    # fork_rng: seed the initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        return DeepFactorizationMachineModel([args["rows"]] * args["num_fields"], args["emb_dim"],
                                             parse_hidden(args["mlp"]), args["dropout"])


def _parameter_count(args: dict[str, Any]) -> tuple[int, int, int]:
    """Parameters of the model for ``args``, counted, not built (see ``limits``): (the shared
    embedding, the linear term, the MLP)."""
    vocabulary = args["num_fields"] * args["rows"]
    widths = [args["num_fields"] * args["emb_dim"], *parse_hidden(args["mlp"])]
    hidden = sum(n * m + m + 2 * m for n, m in zip(widths, widths[1:]))  # Linear, then BatchNorm1d's affine
    return vocabulary * args["emb_dim"], vocabulary + 1, hidden + widths[-1] + 1


# Building the pool holds, per example and field, the uniform, the rank, the id (and its
# transposed gather) and the teacher's latent (k floats). Peak host memory measured on a CPU
# (torch 2.13; 24 and 72 batches of 4096, 8 and 26 fields): about 35 B per example plus 51 B
# per field. Rounded up here.
_POOL_BYTES_PER_EXAMPLE = 200
_POOL_BYTES_PER_FIELD = 70


def _needs(args: dict[str, Any]) -> list[Need]:
    """What the model (trained with Adam) and the data pools need, from the arguments alone."""
    embedding, linear, mlp = _parameter_count(args)
    f, rows, e = args["num_fields"], args["rows"], args["emb_dim"]
    return [
        Need("the shared embedding", embedding * TRAINING_BYTES_PER_PARAMETER,
             f"num_fields={f} x rows={rows} x emb_dim={e}"),
        Need("the linear term's table", linear * TRAINING_BYTES_PER_PARAMETER, f"num_fields={f} x rows={rows}"),
        Need("the MLP", mlp * TRAINING_BYTES_PER_PARAMETER, f"mlp={args['mlp']!r}, num_fields={f}, emb_dim={e}"),
        pool_need(args, _POOL_BYTES_PER_EXAMPLE + _POOL_BYTES_PER_FIELD * f),
        popularity_need(f, rows, f"num_fields={f} x rows={rows}"),
    ]  # fmt: skip


_INTS = ("batch", "num_fields", "rows", "emb_dim", "train_batches", "eval_batches", "seed")
"""The integer arguments, checked in this order (bounds: ``limits.INT_BOUNDS`` and :data:`_BOUNDS`)."""
_BOUNDS = {"batch": (2, 2**20), "num_fields": (1, 1024)}
"""Bounds of this workload's own: far above any real run, low enough that no argument can make
the factory hang; batch >= 2, as BatchNorm1d cannot normalise one example in training."""


# wide: the workload's user-facing arguments (--arg key=value)
def workload(
    *,
    batch: int = 4096,
    num_fields: int = 26,
    rows: int = 100_000,
    emb_dim: int = 16,
    mlp: str = "400-400-400",
    dropout: float = 0.0,
    lr: float = 1e-3,
    train_batches: int = 64,
    eval_batches: int = 8,
    seed: int = 0,
) -> Workload:
    """DeepFM on synthetic clicks. Defaults are sized for one GPU: 26 fields (Criteo's
    categorical ones) of 100,000 rows, dim 16 and hidden widths 400-400-400 as pytorch-fm's
    examples use, batch 4096 (about 0.7 GB of weights and Adam state); a CPU test uses e.g.
    ``batch=256, num_fields=8, rows=50, emb_dim=8, mlp="32-32"``.

    ``mlp`` lists the MLP's hidden widths (each Linear, BatchNorm1d, ReLU, Dropout; the
    output layer to 1 is added). ``dropout`` is the MLP's (see the module docstring).
    ``lr`` is Adam's, 1e-3 as in pytorch-fm's examples: at the default sizes (26 fields of
    10,000 rows, 428 steps, on a CPU) held-out NE was 0.699 at 1e-3, 0.713 at 3e-3 and 0.863
    at 1e-2; the small CPU test sizes learn faster at 1e-2. Give a
    run at least as many ``train_batches`` as steps: CTR models over-fit once they see
    examples again (see ``ctr``).
    """
    args = dict(locals())
    check_ints("deepfm", args, _INTS, _BOUNDS)
    parse_hidden(mlp)
    check_arg("deepfm", "dropout", dropout, 0.0 <= dropout < 1.0, "a number in [0, 1)")
    check_arg("deepfm", "lr", lr, lr > 0 and math.isfinite(lr), "a finite number > 0")
    return builtin_workload("deepfm", args, _needs, build_model=_build_model, make_data=_make_data,
                            make_example=_make_example, loss_fn=F.binary_cross_entropy_with_logits,
                            cut_candidates=CANDIDATES,
                            optimizer=functools.partial(fused_if_cuda, torch.optim.Adam, lr=lr))
