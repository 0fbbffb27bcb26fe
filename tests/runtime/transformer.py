"""A small GPT-like transformer for the tests: rotary attention, value embeddings, bf16 compute.

What the issue's public GPT (nanochat) does that the other test models do not: queries and
keys rotated by position (RoPE), a per-layer value embedding of the tokens mixed into the
attention values through a learned gate, a learned mix of the first layer's activations ``x0``
into every block (so a cut block does not cut the embedding off), and the forward computed in
bfloat16 under autocast (parameters stay float32, as with mixed precision). Blocks take
``(x, x0, idx)``; a cut of a block detaches all three (the ids carry no gradient anyway).

:func:`transformer_workload` wraps it as a :class:`~erase_tune.workloads.Workload` with a
planted next-token rule a few steps of AdamW can learn, so NE moves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from erase_tune.workloads import Workload, WorkloadData
from erase_tune.workloads.base import prior_entropy

__all__ = ["TinyGPT", "gpt_loss", "gpt_batch", "transformer_workload", "VOCAB"]

VOCAB = 48


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension by the position's angle."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ve_gate = nn.Linear(d, heads, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd // 2, dtype=torch.float32) / (self.hd // 2)))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos()[None, None], persistent=False)
        self.register_buffer("sin", angles.sin()[None, None], persistent=False)

    def forward(self, x: torch.Tensor, ve: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v, ve = (z.reshape(b, t, self.heads, self.hd).transpose(1, 2) for z in (q, k, v, ve))
        gate = 2 * torch.sigmoid(self.ve_gate(x)).transpose(1, 2)[..., None]  # (b, heads, t, 1)
        v = v + gate * ve.to(v.dtype)  # value embedding mixed in, per head
        q, k = _rotary(q, self.cos[:, :, :t], self.sin[:, :, :t]), _rotary(k, self.cos[:, :, :t], self.sin[:, :, :t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.value_embed = nn.Embedding(vocab, d)
        self.attn = Attention(d, heads, seq)
        self.mlp = MLP(d)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor, x0: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attn(F.rms_norm(x, (x.shape[-1],)), self.value_embed(idx))
        return x + self.mlp(F.rms_norm(x, (x.shape[-1],)))


class TinyGPT(nn.Module):
    """(B, T) token ids → (B, T, vocab) float32 logits; the body runs in bf16 under autocast."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, heads: int = 2, layers: int = 3, seq: int = 16,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, seq, vocab) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        device = idx.device.type
        with torch.autocast(device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            x = x0 = F.rms_norm(self.embed(idx), (self.embed.embedding_dim,))
            for block in self.blocks:
                x = block(x, x0, idx)
            logits = self.head(F.rms_norm(x, (x.shape[-1],)))
        return logits.float()


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def gpt_batch(n: int = 8, seq: int = 16, seed: int = 0, vocab: int = VOCAB) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Tokens whose next token is (3·token + 1) mod vocab three times in four (learnable, not trivial)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    for t in range(1, seq + 1):
        rule = (3 * x[:, t - 1] + 1) % vocab
        keep = torch.rand(n, generator=g) < 0.75
        x[:, t] = torch.where(keep, rule, x[:, t])
    return (x[:, :-1].contiguous(),), x[:, 1:].contiguous()


def transformer_workload(batch: int = 8, seq: int = 16, train_batches: int = 16, eval_batches: int = 2,
                         dtype: str = "bfloat16") -> Workload:
    """TinyGPT as a workload (``tests.runtime.transformer:transformer_workload`` in a space file)."""

    def build() -> nn.Module:
        torch.manual_seed(1234)
        return TinyGPT(seq=seq, dtype=getattr(torch, dtype))

    def make_data(device: torch.device) -> WorkloadData:
        def moved(b):
            (x,), y = b
            return (x.to(device),), y.to(device)

        train = [moved(gpt_batch(batch, seq, seed=i)) for i in range(train_batches)]
        ev = [moved(gpt_batch(batch, seq, seed=10_000 + i)) for i in range(eval_batches)]
        labels = torch.cat([y.flatten().cpu() for _, y in train])
        return WorkloadData(train=train, eval=ev, prior_entropy=prior_entropy(labels, VOCAB))

    return Workload(
        name="tests.runtime.transformer:transformer_workload",
        args={"batch": batch, "seq": seq, "train_batches": train_batches, "eval_batches": eval_batches,
              "dtype": dtype},
        build_model=build, loss_fn=gpt_loss, make_data=make_data,
        cut_candidates=("blocks.0", "blocks.1.mlp", "blocks.2.mlp"), batch_size=batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        make_example=lambda device: tuple(t.to(device) if isinstance(t, torch.Tensor) else (t[0].to(device),)
                                          for t in gpt_batch(batch, seq, seed=0)),
    )
