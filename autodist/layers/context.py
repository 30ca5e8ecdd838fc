"""Attention over a sequence split across ranks (context parallelism), exact against one process.

A long sequence is cut into ``2K`` chunks as evenly as possible and rank ``r`` of ``K`` holds chunks ``r`` and
``2K-1-r`` (the "zigzag" of Megatron-Core and torch's context parallel): under a causal mask an early chunk
attends to few keys and a late one to many, so each rank holds one of each and every rank does the same
attention work (:meth:`SequenceSplit.work` counts it). Every activation outside attention is per token, so each
rank runs the model on its own tokens; attention alone mixes along the sequence. :func:`context_attention`
gathers the keys and values of the whole sequence (one all-gather for both), and each local chunk attends only to
the keys before its end, with the mask built from global positions: causal, a padding mask over the keys,
packed documents (a token sees only its own document) and a sliding window. With a causal mask alone, on CPU,
no mask is built (:class:`_CausalSplit`: torch's flash kernel on the keys before the chunk and, causally, on
its own block, merged by their log-sum-exp), and the keys and values are gathered again in backward rather
than kept. Backward sums the keys' and values' gradients over the ranks (one all-reduce) and keeps this rank's
tokens; a rank holding no token still takes part.

The result is one process's attention on the whole sequence: the same scores and softmax over the same keys,
only computed for this rank's rows (float64: within 1e-10 of one process, the bound the tests hold it to).
Any length works, a length under ``2K`` included (a rank may then hold no token).

Example:
    On each of K ranks (``group``: the ranks sharing one sequence), with q, k, v of the whole sequence::

        split = SequenceSplit(length=q.shape[-2], parts=K)
        mine = [split.split(t, rank, dim=-2) for t in (q, k, v)]       # this rank's tokens
        out = context_attention(*mine, split=split, group=group)       # = SDPA(q, k, v, is_causal=True)'s rows
        full = split.gather(out, group, dim=-2)                         # the whole output, if wanted
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autodist.layers.comm import group_rank_size, shard_sizes


@dataclass(frozen=True)
class SequenceSplit:
    """Which positions of a sequence of ``length`` tokens each of ``parts`` ranks holds (zigzag, see the module
    docstring); a rank's tokens are kept in ascending position.

    Example:
        >>> SequenceSplit(10, 2).positions(0).tolist()   # chunks of 3, 3, 2, 2: rank 0 holds the first and last
        [0, 1, 2, 8, 9]
    """

    length: int
    parts: int

    def __post_init__(self) -> None:
        if self.parts < 1 or self.length < 0:
            raise ValueError(f"a sequence split needs length >= 0 and parts >= 1, got length={self.length}, "
                             f"parts={self.parts}")

    @cached_property
    def chunks(self) -> list[tuple[int, int]]:
        """The ``2 * parts`` chunks' ``[lo, hi)`` positions, in sequence order."""
        bounds, lo = [], 0
        for width in shard_sizes(self.length, 2 * self.parts):
            bounds.append((lo, lo + width))
            lo += width
        return bounds

    def held(self, rank: int) -> list[tuple[int, int]]:
        """The chunks rank ``rank`` holds, in ascending position: ``r`` and ``2 * parts - 1 - r``."""
        return [self.chunks[rank], self.chunks[2 * self.parts - 1 - rank]]

    def positions(self, rank: int) -> torch.Tensor:
        """The positions in the whole sequence of rank ``rank``'s tokens, ascending."""
        return torch.cat([torch.arange(lo, hi) for lo, hi in self.held(rank)])

    @cached_property
    def sizes(self) -> list[int]:
        """Tokens held by each rank."""
        return [sum(hi - lo for lo, hi in self.held(r)) for r in range(self.parts)]

    def split(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of ``x``, whose dimension ``dim`` is the whole sequence (no communication)."""
        if x.shape[dim] != self.length:
            raise ValueError(f"expected the whole sequence ({self.length} tokens) in dimension {dim}, got shape "
                             f"{tuple(x.shape)}")
        return x.index_select(dim, self.positions(rank).to(x.device))

    def gather(self, x: torch.Tensor, group: Any = None, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's tokens, in position order (differentiable: backward keeps this
        rank's tokens of the gradient summed over the ranks)."""
        return _GatherSequence.apply(x, self, group, dim)

    def work(self, rank: int, causal: bool = True) -> int:
        """Query-key pairs rank ``rank``'s attention computes: each chunk's rows times the keys before its end
        (all keys without a causal mask)."""
        return sum((hi - lo) * (hi if causal else self.length) for lo, hi in self.held(rank))


class _GatherSequence(torch.autograd.Function):
    """Every rank's tokens, in position order, forward; the gradient summed over the ranks and this rank's tokens
    kept, backward (each rank's copy of the sequence was used by its own rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit, group: Any, dim: int) -> torch.Tensor:
        ctx.split, ctx.group, ctx.dim, ctx.rank = split, group, dim % x.ndim, _rank_in(split, group)
        return _whole(x, split, group, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        total = grad.contiguous().clone()
        if ctx.split.parts > 1:
            dist.all_reduce(total, group=ctx.group)
        return total.index_select(ctx.dim, ctx.split.positions(ctx.rank).to(grad.device)), None, None, None


def _rank_in(split: SequenceSplit, group: Any) -> int:
    """This rank's index in ``group``, which must have one rank per part of ``split``."""
    rank, size = group_rank_size(group)
    if size != split.parts:
        raise ValueError(f"the sequence is split over {split.parts} ranks but the group has {size}: build the "
                         f"SequenceSplit with parts equal to the group's size")
    return rank


def _whole(x: torch.Tensor, split: SequenceSplit, group: Any, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's tokens of ``x``, in position order (one all-gather; no autograd).

    The ranks' parts land in one buffer (gloo's all-gather takes equal shapes: each padded to the most any rank
    holds) and each chunk is copied straight to its place: two copies of the whole sequence at most, for a
    moment (concatenating, then ordering, held three)."""
    x, dim = x.detach(), dim % x.ndim
    if split.parts == 1:
        return x.clone()
    widest, held = max(split.sizes), x.shape[dim]
    shape = (*x.shape[:dim], widest, *x.shape[dim + 1:])
    mine = x.contiguous() if held == widest else torch.cat([x, x.new_zeros(*shape[:dim], widest - held,
                                                                               *shape[dim + 1:])], dim=dim)
    parts = x.new_empty(split.parts, *shape)
    dist.all_gather(list(parts.unbind(0)), mine, group=group)
    whole = x.new_empty(*shape[:dim], split.length, *shape[dim + 1:])
    for rank in range(split.parts):
        start = 0
        for lo, hi in split.held(rank):
            whole.narrow(dim, lo, hi - lo).copy_(parts[rank].narrow(dim, start, hi - lo))
            start += hi - lo
    return whole


def attention_mask(rows: torch.Tensor, keys: torch.Tensor, *, causal: bool, window: int | None,
                   documents: torch.Tensor | None, key_padding: torch.Tensor | None) -> torch.Tensor | None:
    """Which keys each row may attend to (True: attend), from global positions: ``rows`` (R,) and ``keys`` (T,);
    ``documents`` (B, S) or (S,) each position's document; ``key_padding`` (B, S), True where a key is a token.
    Returns None where every pair is allowed, else a mask that broadcasts to (B, 1, R, T)."""
    mask = None
    q, k = rows[:, None], keys[None, :]
    if causal:
        mask = k <= q
    if window is not None:
        near = k > q - window
        mask = near if mask is None else mask & near
    if documents is not None:
        docs = documents if documents.ndim == 2 else documents[None]
        same = docs[:, rows][:, :, None] == docs[:, keys][:, None, :]  # (B or 1, R, T)
        mask = same if mask is None else mask & same
    if key_padding is not None:
        real = key_padding[:, keys][:, None, :]  # (B, 1, T)
        mask = real if mask is None else mask & real
    if mask is None:
        return None
    return mask[:, None] if mask.ndim == 3 else mask  # the heads' dimension


def _chunk_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's causal attention over the keys up to its end (``keys`` and ``values`` end there), without a
    mask: the keys before the chunk attended whole and the chunk's own square block causally, each by torch's
    CPU flash kernel, merged by their log-sum-exp. Returns the output and the merged log-sum-exp."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, keys[..., lo:, :], values[..., lo:, :], 0.0, True, scale=scale)
    if lo:
        before, lse_before = flash(q, keys[..., :lo, :], values[..., :lo, :], 0.0, False, scale=scale)
        merged = torch.logaddexp(lse_before, lse)
        out = (torch.exp(lse_before - merged).unsqueeze(-1).to(out.dtype) * before
               + torch.exp(lse - merged).unsqueeze(-1).to(out.dtype) * out)
        lse = merged
    return out, lse


def _chunk_backward(grad: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, lo: int, scale: float, dkv: torch.Tensor) -> torch.Tensor:
    """The kernel's backward on each block of :func:`_chunk_forward` with the merged output and log-sum-exp,
    which gives each block's exact share (the identity ring attention rests on): dq returned, the gradients of
    the keys and values up to the chunk's end added into ``dkv`` (keys' features first) block by block (no
    copy of them joined)."""
    back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    width = keys.shape[-1]
    dq, dk, dv = back(grad, q, keys[..., lo:, :], values[..., lo:, :], out, lse, 0.0, True, scale=scale)
    dkv[..., lo:lo + dk.shape[-2], :width] += dk
    dkv[..., lo:lo + dv.shape[-2], width:] += dv
    if lo:
        dq_before, dk, dv = back(grad, q, keys[..., :lo, :], values[..., :lo, :], out, lse, 0.0, False, scale=scale)
        dkv[..., :lo, :width] += dk
        dkv[..., :lo, width:] += dv
        dq += dq_before
    return dq


class _CausalSplit(torch.autograd.Function):
    """This rank's causal attention over the whole sequence, with no mask built (see :func:`_chunk_forward`).
    The whole sequence's keys and values are gathered in forward and again in backward, not kept in between:
    a rank keeps its own tokens' q, k, v, output and log-sum-exp for backward (half of one process's at 2
    ranks, where keeping the gathered keys and values would be three quarters)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, group: Any,
                rank: int, scale: float, groups: int) -> torch.Tensor:
        ctx.split, ctx.group, ctx.rank, ctx.scale, ctx.width = split, group, rank, scale, k.shape[-1]
        ctx.groups = groups
        keys, values = _gathered(k, v, split, group, groups)
        outs, lses, start = [], [], 0
        for lo, hi in split.held(ctx.rank):
            if hi > lo:
                out, lse = _chunk_forward(q[..., start:start + hi - lo, :], keys[..., :hi, :], values[..., :hi, :],
                                          lo, scale)
                outs.append(out)
                lses.append(lse)
            start += hi - lo
        out = torch.cat(outs, dim=-2) if outs else q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=-1) if lses else q.new_empty(q.shape[:-1]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        split, width, grad = ctx.split, ctx.width, grad.contiguous()
        keys, values = _gathered(k, v, split, ctx.group, ctx.groups)
        dq = torch.zeros_like(q)
        dkv = torch.zeros(*keys.shape[:-1], width + values.shape[-1], dtype=keys.dtype, device=keys.device)
        start = 0
        for lo, hi in split.held(ctx.rank):
            rows = slice(start, start + hi - lo)
            start += hi - lo
            if hi == lo:
                continue
            dq[..., rows, :] = _chunk_backward(grad[..., rows, :], q[..., rows, :], keys[..., :hi, :],
                                               values[..., :hi, :], out[..., rows, :], lse[..., rows], lo, ctx.scale,
                                               dkv)
        if ctx.groups > 1:  # each key head served `groups` query heads: its gradient is their sum
            dkv = dkv.unflatten(-3, (dkv.shape[-3] // ctx.groups, ctx.groups)).sum(-3)
        if split.parts > 1:
            dist.all_reduce(dkv, group=ctx.group)  # each rank's rows used every key before them
        mine = dkv.index_select(-2, split.positions(ctx.rank).to(dkv.device))
        return dq, mine[..., :width], mine[..., width:], None, None, None, None, None


def _gathered(k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, group: Any,
              groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's keys and values, in position order (one all-gather for both; no autograd), each key
    head repeated for the ``groups`` query heads it serves after the exchange, not before."""
    return _keys_values(_whole(torch.cat([k, v], dim=-1).detach(), split, group, -2), k.shape[-1], groups)


def _keys_values(both: torch.Tensor, width: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (the first ``width`` features) and the values of the whole sequence's ``both``, each key head
    repeated for the ``groups`` query heads it serves."""
    if groups > 1:
        both = both.repeat_interleave(groups, -3)
    return both[..., :width], both[..., width:]


def _groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> int:
    """How many query heads each key head serves (1 without grouped-query attention; a single key head, which
    broadcasts, serves them all)."""
    if q.ndim < 3 or k.shape[-3] == q.shape[-3]:
        return 1
    if (not enable_gqa and k.shape[-3] != 1) or q.shape[-3] % k.shape[-3] or v.shape[-3] != k.shape[-3]:
        raise ValueError(f"q has {q.shape[-3]} heads and k, v have {k.shape[-3]} and {v.shape[-3]}: pass "
                         f"enable_gqa=True for grouped-query attention (the query heads a multiple of the key "
                         f"heads, k and v alike), as F.scaled_dot_product_attention takes it")
    return q.shape[-3] // k.shape[-3]


def fast_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the chunks can run torch's CPU flash kernel unmasked (:class:`_CausalSplit`)."""
    return (q.device.type == "cpu" and q.ndim == 4 and q.dtype in (torch.float64, torch.float32, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, split: SequenceSplit, group: Any = None,
                      causal: bool = True, key_padding: torch.Tensor | None = None,
                      documents: torch.Tensor | None = None, window: int | None = None,
                      scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Scaled dot-product attention of this rank's tokens over the whole sequence split by ``split``.

    Args:
        q, k, v: this rank's tokens, ``(..., tokens, head_dim)`` as ``F.scaled_dot_product_attention`` takes them
            (``split.split(x, rank, dim=-2)`` of the whole sequence's); the same leading shape on every rank.
        split: how the sequence is split (the same on every rank of ``group``).
        group: the ranks sharing the sequence (None: every rank).
        causal: each token attends to the tokens up to itself (``is_causal=True``).
        key_padding: ``(batch, length)`` bool over the whole sequence, True where a key is a real token (Hugging
            Face's ``attention_mask``); the same on every rank.
        documents: ``(batch, length)`` or ``(length,)`` each position's document (packed sequences): a token
            attends only within its own.
        window: a sliding window: each token attends to the ``window`` latest positions up to itself.
        scale: the scores' scale (None: ``1/sqrt(head_dim)``).
        enable_gqa: grouped-query attention, as ``F.scaled_dot_product_attention`` takes it: ``k`` and ``v``
            have fewer heads than ``q`` (a divisor of them), each serving that many query heads in turn. They are
            exchanged with their own heads and repeated after (the bytes sent: the key heads', not the query
            heads').

    Returns:
        This rank's rows of the attention output, ``(..., tokens, head_dim)``; a row with no key allowed is what
        one process's ``F.scaled_dot_product_attention`` gives it (zeros in torch 2.13).

    Example:
        >>> out = context_attention(q_mine, k_mine, v_mine, split=SequenceSplit(4096, 2), group=cp_group)
    """
    rank = _rank_in(split, group)
    if q.shape[-2] != split.sizes[rank]:
        raise ValueError(f"rank {rank} holds {split.sizes[rank]} tokens of the {split.length}-token sequence, but "
                         f"q has {q.shape[-2]} in dimension -2 (shape {tuple(q.shape)}): pass "
                         f"split.split(q, rank, dim=-2)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    groups = _groups(q, k, v, enable_gqa)
    if causal and window is None and documents is None and key_padding is None and fast_path(q, k, v):
        return _CausalSplit.apply(q, k, v, split, group, rank, scale, groups)
    both = split.gather(torch.cat([k, v], dim=-1), group, dim=-2)  # one collective each way, in one order
    keys, values = _keys_values(both, k.shape[-1], groups)
    outs, start = [], 0
    for lo, hi in split.held(rank):
        rows = q[..., start:start + hi - lo, :]
        start += hi - lo
        if hi == lo:  # a sequence shorter than 2K tokens: this chunk is empty, its backward still sums with the others
            outs.append(rows @ keys[..., :0, :].transpose(-1, -2) @ values[..., :0, :])
            continue
        end = hi if causal else split.length  # keys past a causal chunk's end are never attended to
        mask = attention_mask(torch.arange(lo, hi, device=q.device), torch.arange(end, device=q.device),
                              causal=causal, window=window, documents=documents, key_padding=key_padding)
        outs.append(F.scaled_dot_product_attention(rows, keys[..., :end, :], values[..., :end, :], attn_mask=mask,
                                                   scale=scale))
    return torch.cat(outs, dim=-2)
