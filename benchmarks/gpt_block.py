"""A nanoGPT-style decoder for bench_mp.py's transformer case (and bench_pipeline.py's model), with q, k and v as
separate Linears.

Written as torchtitan writes its attention (separate ``wq``/``wk``/``wv``, ``view(B, T, n_head, head_dim)``),
so that torch tensor parallelism can split it with torchtitan's plan: it needs ``n_head`` set to the local
head count on each rank (:func:`local_heads`), which is what torchtitan does. autodist runs the dense model as
it is. Not a benchmark itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.wq, self.wk, self.wv = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B * T, vocab), flattened for cross-entropy; with ``flat=False`` (B, T, vocab),
    the batch dimension kept (pipeline parallelism puts its micro-batches' outputs together along it)."""

    def __init__(self, vocab: int = 256, width: int = 256, heads: int = 4, layers: int = 4, seq: int = 128, *,
                 flat: bool = True) -> None:
        super().__init__()
        self.flat = flat
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits.flatten(0, 1) if self.flat else logits


def tp_plan(layers: int) -> dict:
    """torchtitan's plan for these blocks: q, k, v and fc column-wise, the output and proj row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        plan |= {f"blocks.{i}.attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {f"blocks.{i}.attn.wo": RowwiseParallel(), f"blocks.{i}.fc": ColwiseParallel(),
                 f"blocks.{i}.proj": RowwiseParallel()}
    return plan


def local_heads(model: GPT, parts: int) -> None:
    """What torchtitan does after splitting: each attention runs its rank's heads."""
    for block in model.blocks:
        block.attn.n_head //= parts


def batch(rows: int, seq: int, vocab: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, seq), generator=g)
    return x, torch.roll(x, -1, 1).flatten()
