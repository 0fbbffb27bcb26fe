"""GPT proxy: a small NanoChat-like byte-level decoder, trained on Python's own source.

The paper traces ERASE on NanoChat to show one block's backward overlapping the next
block's forward, and where that stops (a fused attention kernel that fills the device).
This is the same shape of model, small enough for a CPU test: byte vocabulary (no
tokenizer to ship), learned positions, pre-norm blocks with parameter-free RMSNorm and a
ReLU² MLP as in nanochat. Each block does both residual adds itself, so a run of blocks is
a plain chain ``for b in blocks: x = b(x)`` and a cut can detach any run of them.

The chain starts with the input stage: ``blocks.0`` is the token + position embedding, and
``blocks.1`` to ``blocks.n_layer`` are the transformer blocks; the final norm and ``lm_head``
stay outside. A cut detaches its input, so a cut after the embedding would leave it with no
gradient from anything; inside the chain, the first piece (``blocks.0:k``) owns it and trains
it with its local loss. The paper's NanoChat split, two detachment points and three pieces,
is then ``blocks.0:3`` (embedding + two blocks, local loss), ``blocks.3:5`` (two blocks,
local loss) and the rest with the main loss. ``lm_head`` is not tied to the token embedding
(nanochat unties them too): a tied matrix would belong to the first piece and to the
remainder at once, trained by two losses across a detachment, so a piece would not be a
piece.

The text is the ``.py`` files of the standard library: it ships with every Python, so the
workload needs no download, and it is read in sorted order so the bytes are reproducible
on one installation.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError, shown
from erase_tune.workloads import fused_if_cuda
from erase_tune.workloads.base import Batch, Workload, WorkloadData, builtin_workload, prior_entropy
from erase_tune.workloads.limits import TRAINING_BYTES_PER_PARAMETER, Need, check_arg, check_ints

__all__ = [
    "VOCAB_SIZE",
    "Embed",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "GPT",
    "cut_candidates",
    "stdlib_text",
    "workload",
]

VOCAB_SIZE = 256
"""Bytes."""


def _norm(x: Tensor) -> Tensor:
    # Parameter-free RMSNorm, as nanochat: nothing to learn, nothing for a cut to own.
    return F.rms_norm(x, (x.shape[-1],))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) → (B, T, C)."""

    def __init__(self, *, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Position-wise ReLU² MLP: (B, T, C) → (B, T, C)."""

    def __init__(self, *, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    """Pre-norm transformer block with both residual adds inside: (B, T, C) → (B, T, C)."""

    def __init__(self, *, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(n_embd=n_embd, n_head=n_head)
        self.mlp = MLP(n_embd=n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(_norm(x))
        return x + self.mlp(_norm(x))


class Embed(nn.Module):
    """Byte + learned position embedding: ``idx (B, T) int64 -> (B, T, C)``, T ≤ seq_len.
    The chain's first block."""

    def __init__(self, *, seq_len: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class GPT(nn.Module):
    """Byte-level decoder: ``forward(idx (B, T) int64) -> logits (B, T, 256)``, T ≤ seq_len.

    ``blocks`` is the chain: ``blocks.0`` the :class:`Embed`, then ``n_layer`` transformer
    blocks; any run ``blocks.i:j`` is a cut target, and ``blocks.0:j`` is one that leaves no
    parameter upstream of it. The final norm and ``lm_head`` (untied) follow the chain.
    """

    def __init__(self, *, seq_len: int, n_layer: int, n_head: int, n_embd: int, dtype: str = "float32") -> None:
        super().__init__()
        # "bfloat16": the forward runs under autocast in bf16 (parameters stay float32), as
        # nanochat computes on an H200; the logits come back in float32 either way.
        self.compute_dtype = dtype
        # Built in the order the parameters always were (embeddings, blocks, head), so a seed
        # gives the same weights as before the embedding joined the chain.
        blocks: list[nn.Module] = [Embed(seq_len=seq_len, n_embd=n_embd)]
        blocks += [Block(n_embd=n_embd, n_head=n_head) for _ in range(n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        # GPT-2 initialisation; residual projections shrink with depth so the residual
        # stream's variance does not grow with the number of blocks.
        for name, param in self.named_parameters():
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        # No autocast cache: a whole-step CUDA graph captures this forward.
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == "bfloat16",
                            cache_enabled=False):
            x = idx
            for block in self.blocks:
                x = block(x)
            return self.lm_head(_norm(x)).float()


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean next-byte cross-entropy: logits (B, T, 256), target (B, T) int64."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def _source_files() -> Iterator[Path]:
    """Python source files: the standard library first, then installed packages as a fallback.

    Folders are walked lazily in sorted order, so the sequence is deterministic and only as
    much of the tree is listed as the bytes asked for need.
    """
    paths = sysconfig.get_paths()
    # Third-party packages can live under the stdlib folder (pyenv, conda): leave them out
    # of the primary source, whose bytes should depend on the Python version only.
    skip = {"site-packages", "dist-packages", "__pycache__"}
    roots = [paths["stdlib"], paths["purelib"], *(p for p in sys.path if p)]
    seen: set[str] = set()
    for i, root in enumerate(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if i > 0 or d not in skip)
            for file in sorted(files):
                path = os.path.join(folder, file)
                if file.endswith(".py") and path not in seen:
                    seen.add(path)
                    yield Path(path)


@functools.lru_cache(maxsize=8)
def stdlib_text(nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of Python source on this installation (fewer if there is
    not that much), files concatenated in sorted path order. Cached per process."""
    chunks, total = [], 0
    for path in _source_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= nbytes:
            break
    return b"".join(chunks)[:nbytes]


def _windows(text: Tensor, count: int, length: int, gen: torch.Generator, shuffle: bool) -> Tensor:
    """``count`` windows of ``length`` bytes from ``text``: disjoint when it is long enough,
    else at random (overlapping) offsets."""
    if len(text) >= count * length:
        windows = text[: count * length].view(count, length)
        return windows[torch.randperm(count, generator=gen)] if shuffle else windows
    starts = torch.randint(0, len(text) - length + 1, (count,), generator=gen)
    return text[starts.unsqueeze(1) + torch.arange(length)]


def _make_data(device: torch.device, *, args: dict[str, Any]) -> WorkloadData:
    batch, length = args["batch"], args["seq_len"] + 1  # one extra byte: the last target
    n_train, n_eval = args["train_batches"] * batch, args["eval_batches"] * batch
    want = (n_train + n_eval) * length
    raw = stdlib_text(want)
    if len(raw) < 4 * length:
        raise WorkloadError(f"workload 'gpt': found only {len(raw)} bytes of Python source, need at least {4 * length}")
    text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    # Held-out text is the tail: other files than the training text (sorted order), never overlapping it.
    split = min(n_train * length, len(text) * n_train // (n_train + n_eval))
    gen = torch.Generator().manual_seed(args["seed"])
    train = _windows(text[:split], n_train, length, gen, shuffle=True).to(device)
    held = _windows(text[split:], n_eval, length, gen, shuffle=False).to(device)

    def batches(windows: Tensor) -> list[Batch]:
        return [((w[:, :-1],), w[:, 1:]) for w in windows.split(batch)]

    return WorkloadData(
        train=batches(train),
        eval=batches(held),
        prior_entropy=prior_entropy(train[:, 1:], num_classes=VOCAB_SIZE),
    )


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def _build_model(*, args: dict[str, Any]) -> GPT:
    # fork_rng: seed the initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        return GPT(seq_len=args["seq_len"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"],
                   dtype=args.get("dtype", "float32"))


def _example(device: torch.device, *, args: dict[str, Any]) -> Batch:
    """The first training batch of a one-batch pool: reads two batches' worth of text,
    whatever ``train_batches`` is."""
    return _make_data(device, args={**args, "train_batches": 1, "eval_batches": 1}).batch(0)


_INTS = ("batch", "seq_len", "n_layer", "n_head", "n_embd", "train_batches", "eval_batches", "seed")
"""The integer arguments, checked in this order (bounds: ``limits.INT_BOUNDS`` and :data:`_BOUNDS`)."""
_BOUNDS = {"seq_len": (1, 2**17), "n_layer": (1, 256), "n_head": (1, 2**12), "n_embd": (1, 2**16)}
"""Bounds on this workload's own integer arguments: far above any real run, low enough that no
argument can make the factory hang."""

_BYTES_PER_TOKEN = 32
"""Peak host memory per byte of the pools while building them: the windows (int64), their
gather indices, the shuffled copy and the source text as int64. Measured 26 B on a CPU
(torch 2.13; 400 and 2000 batches of 64 x 1025 bytes)."""


def _parameter_count(args: dict[str, Any]) -> int:
    """Parameters of :class:`GPT` for ``args`` (counted, not built: see ``limits``)."""
    c = args["n_embd"]
    # Byte and position embeddings, the head, and per block qkv (3c²), proj (c²) and the MLP (8c²).
    return (2 * VOCAB_SIZE + args["seq_len"]) * c + args["n_layer"] * 12 * c * c


def _needs(args: dict[str, Any]) -> list[Need]:
    """What the model (trained with AdamW) and the data pools need, from the arguments alone."""
    params = _parameter_count(args)
    tokens = (args["train_batches"] + args["eval_batches"]) * args["batch"] * (args["seq_len"] + 1)
    return [
        Need(
            "the model",
            params * TRAINING_BYTES_PER_PARAMETER,
            f"n_layer={args['n_layer']}, n_embd={args['n_embd']}, seq_len={args['seq_len']}",
        ),
        Need(
            "the train/eval pools",
            tokens * _BYTES_PER_TOKEN,
            f"batch={args['batch']} x seq_len={args['seq_len']} x "
            f"(train_batches={args['train_batches']} + eval_batches={args['eval_batches']})",
        ),
    ]


def cut_candidates(n_layer: int) -> tuple[str, ...]:
    """Cut candidates of an ``n_layer``-block model, in chain order, upstream first.

    First the pieces: two transformer blocks each, the first piece together with the
    embedding (``blocks.0:3``, ``blocks.3:5``, ``blocks.5:7``, ...; the last one holds a
    single block when ``n_layer`` is odd). Detaching the first ``k`` of them leaves no
    parameter untrained (``blocks.0:3`` + ``blocks.3:5`` is the paper's two detachment
    points); detaching a later one without those before it starves the embedding and the
    blocks upstream of it, which is why they come first (a search offers "detach" for a
    candidate only once the candidates before it cover its upstream). Then every transformer
    block alone (``blocks.1`` ... ``blocks.n_layer``), for placement on a side stream (a
    placement detaches nothing, so it starves nothing); a block that is already a one-block
    piece is not repeated. The embedding alone is no candidate: as a cut it would train the
    byte table as a bigram model, and as a placement it is too little work to overlap.
    """
    bounds = [0, *range(3, n_layer + 1, 2), n_layer + 1]
    pieces = [f"blocks.{a}:{b}" for a, b in zip(bounds, bounds[1:])]
    singles = [f"blocks.{i}" for i in range(1, n_layer + 1) if f"blocks.{i}:{i + 1}" not in pieces]
    return tuple(pieces + singles)


# wide: the workload's user-facing arguments (--arg key=value)
def workload(
    *,
    batch: int = 8,
    seq_len: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 64,
    train_batches: int = 16,
    eval_batches: int = 4,
    lr: float = 3e-4,
    seed: int = 0,
    dtype: str = "float32",
) -> Workload:
    """The GPT proxy. Defaults suit a CPU; a GPU trial might use ``batch=32, seq_len=1024,
    n_layer=12, n_head=6, n_embd=768``. ``dtype``: ``float32``, or ``bfloat16`` compute
    (autocast; parameters and logits stay float32)."""
    args = dict(locals())
    check_ints("gpt", args, _INTS, _BOUNDS)
    if dtype not in ("float32", "bfloat16"):
        raise WorkloadError(f"workload 'gpt': argument 'dtype' must be 'float32' or 'bfloat16', got {shown(dtype)}")
    if n_embd % n_head:
        raise WorkloadError(f"workload 'gpt': argument 'n_embd' ({n_embd}) must be a multiple of 'n_head' ({n_head})")
    check_arg("gpt", "lr", lr, lr > 0 and math.isfinite(lr), "a finite number > 0")
    return builtin_workload("gpt", args, _needs, build_model=_build_model, make_data=_make_data,
                            make_example=_example, loss_fn=lm_loss, cut_candidates=cut_candidates(n_layer),
                            optimizer=functools.partial(fused_if_cuda, torch.optim.AdamW, lr=lr))
