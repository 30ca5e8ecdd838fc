"""``nn.MultiheadAttention`` split by heads over a model-parallel group, exact against the dense module.

torch's attention holds q, k and v in one packed ``in_proj_weight`` (3E x E)
and applies ``out_proj`` inside its own forward (``F.multi_head_attention_forward``),
so no Linear of it can be swapped on its own. :class:`MPMultiheadAttention`
replaces the whole module: each rank holds ``num_heads / K`` heads - its rows
of q, of k and of v (three blocks of ``in_proj_weight``) and the matching
columns of ``out_proj`` - and runs attention on them; ``out_proj`` sums the
ranks' parts (one all-reduce forward), and backward all-reduces the input's
gradient once per distinct input (one for self-attention, two for a decoder's
cross-attention on ``(x, memory)``). Masks (``attn_mask`` 2-D or per head 3-D,
``key_padding_mask``, ``is_causal``), ``batch_first``, unbatched inputs and
dropout behave as in torch: attention dropout multiplies each rank's heads by
their part of the mask one process draws (:func:`dropout_mask`). Returned
attention weights are the dense ones: averaged over all heads (one more
all-reduce) or, with ``average_attn_weights=False``, every head (an
all-gather); pass ``need_weights=False`` where they are not used, as torch's
Transformer layers do.

Parameter names are the dense module's (``in_proj_weight``, ``in_proj_bias``,
``out_proj.weight``, ``out_proj.bias``), so ``gather_state_dict`` and
checkpoints see the original model. torch's fast paths (the fused
``TransformerEncoderLayer`` kernel, nested tensors) read the packed weights
themselves; this module tells them to stay off (``_qkv_same_embed_dim`` is
False, the attribute they check), which changes no result.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autodist.layers.comm import copy_to_group, gather_last_dim, group_rank_size, reduce_from_group_
from autodist.layers.dropout import dropout_mask
from autodist.layers.linear import RowParallelLinear, _GroupHandle
from autodist.layers.shard import Shard


def why_not_split(module: nn.MultiheadAttention, parts: int) -> str | None:
    """Why ``module`` cannot be split by heads over ``parts`` ranks (None: it can)."""
    if not module._qkv_same_embed_dim:
        return "its key/value widths differ from the query's (kdim/vdim): separate q, k, v weights are not split yet"
    if module.num_heads % parts:
        return f"its {module.num_heads} heads do not divide by mp={parts}"
    if module.bias_k is not None or module.add_zero_attn:
        return "add_bias_kv / add_zero_attn append a key to every head, which is not split yet"
    return None


class MPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with each rank running ``num_heads / K`` of the heads (see the module docstring).

    Args:
        dense: the module to split; it is not changed.
        group: the process group to split over (None: every rank).

    Example:
        >>> layer = nn.TransformerEncoderLayer(256, 8, batch_first=True)
        >>> layer.self_attn = MPMultiheadAttention.from_dense(layer.self_attn, group=mp_group)
        >>> y = layer(x)        # as the dense layer computes it; one all-reduce forward, one backward
    """

    _qkv_same_embed_dim = False  # keeps torch's fused fast paths, which read the packed weights, off

    def __init__(self, dense: nn.MultiheadAttention, group: Any = None) -> None:
        super().__init__()
        self.rank, self.parts = group_rank_size(group)
        why = why_not_split(dense, self.parts)
        if why is not None:
            raise ValueError(f"MPMultiheadAttention cannot split this nn.MultiheadAttention: {why}")
        self._group = _GroupHandle(group)
        self.embed_dim, self.num_heads, self.dropout = dense.embed_dim, dense.num_heads, dense.dropout
        self.batch_first, self.head_dim = dense.batch_first, dense.head_dim
        self.local_heads = dense.num_heads // self.parts
        e = dense.embed_dim
        self.shards = {"in_proj_weight": Shard.even((3 * e, e), 0, (e, e, e), self.parts, self.rank, group),
                       "in_proj_bias": Shard.even((3 * e,), 0, (e, e, e), self.parts, self.rank, group)}
        weight, bias = dense.in_proj_weight, dense.in_proj_bias
        self.in_proj_weight = self.shards["in_proj_weight"].parameter(weight)
        if bias is None:
            self.register_parameter("in_proj_bias", None)
        else:
            self.in_proj_bias = self.shards["in_proj_bias"].parameter(bias)
        self.out_proj = RowParallelLinear.from_dense(dense.out_proj, group=group)
        self.sizes = self.shards["in_proj_weight"].widths()  # every rank's rows of the packed weight

    def _check_group(self) -> None:
        self.out_proj._check_group()

    @classmethod
    def from_dense(cls, dense: nn.MultiheadAttention, *, group: Any = None) -> "MPMultiheadAttention":
        """This rank's heads of ``dense``; the module computes exactly what ``dense`` does."""
        if not isinstance(dense, nn.MultiheadAttention):
            raise TypeError(f"Expect nn.MultiheadAttention for dense, {type(dense).__name__} found")
        return cls(dense, group=group)

    @property
    def group(self) -> Any:
        return self._group.group

    def dense_state(self, local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The dense ``in_proj_weight`` and ``in_proj_bias``, gathered (``out_proj`` gathers its own); ``local``
        as for :meth:`MPLinear.dense_state`. Communicates: every rank of the group must call it."""
        local = local or {}
        return {key: self.shards[key].gather(local.get(key, value)) for key, value in
                (("in_proj_weight", self.in_proj_weight), ("in_proj_bias", self.in_proj_bias)) if value is not None}

    def _project(self, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads of q, k and v; each distinct input enters the group once (its gradient is
        all-reduced once in backward)."""
        entered: dict[int, torch.Tensor] = {}
        weights = self.in_proj_weight.chunk(3)
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        out = []
        for x, w, b in zip((query, key, value), weights, biases):
            if id(x) not in entered:
                entered[id(x)] = copy_to_group(x, self.group)
            out.append(F.linear(entered[id(x)], w, b))
        return out[0], out[1], out[2]

    def _heads_mask(self, mask: torch.Tensor, batch: int) -> torch.Tensor:
        """A 3-D (batch x heads, L, S) mask cut to this rank's heads; a 2-D one is shared by every head."""
        if mask.dim() == 2:
            return mask.unsqueeze(0)
        lo = self.rank * self.local_heads
        per_head = mask.view(batch, self.num_heads, *mask.shape[1:])[:, lo:lo + self.local_heads]
        return per_head.reshape(batch * self.local_heads, *mask.shape[1:])

    def _dropout_mask(self, like: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's heads of one process's dropout mask over (batch, heads, L, S) attention probabilities."""
        shape = (batch, self.num_heads) + tuple(like.shape[-2:])
        mask = dropout_mask(Shard.even(shape, 1, None, self.parts, self.rank, self.group), self.dropout, like)
        return mask.view(like.shape)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``nn.MultiheadAttention.forward``."""
        self._check_group()
        batched = query.dim() == 3
        if self.batch_first and batched:
            query, key, value = _each(lambda t: t.transpose(0, 1), query, key, value)
        if not batched:
            query, key, value = _each(lambda t: t.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, batch, _ = query.shape
        src_len = key.shape[0]
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                               "module method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                          target_type=query.dtype, check_other=False)
            if key_padding_mask is not None:
                is_causal = False
        q, k, v = self._project(query, key, value)
        heads = batch * self.local_heads
        q = q.view(tgt_len, heads, self.head_dim).transpose(0, 1)
        k = k.view(src_len, heads, self.head_dim).transpose(0, 1)
        v = v.view(src_len, heads, self.head_dim).transpose(0, 1)
        if attn_mask is not None:
            attn_mask = self._heads_mask(attn_mask, batch)
        if key_padding_mask is not None:
            padding = key_padding_mask.view(batch, 1, 1, src_len).expand(-1, self.local_heads, -1, -1)
            padding = padding.reshape(heads, 1, src_len)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = q * math.sqrt(1.0 / float(self.head_dim))
            scores = torch.bmm(scores, k.transpose(-2, -1)) if attn_mask is None else \
                torch.baddbmm(attn_mask, scores, k.transpose(-2, -1))
            probs = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                probs = probs * self._dropout_mask(probs, batch)
            out = torch.bmm(probs, v).transpose(0, 1).reshape(tgt_len * batch, -1)
            weights = self._dense_weights(probs.view(batch, self.local_heads, tgt_len, src_len),
                                          average_attn_weights)
        else:
            if attn_mask is not None:
                attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else \
                    attn_mask.view(batch, self.local_heads, -1, src_len)
            q, k, v = (t.view(batch, self.local_heads, -1, self.head_dim) for t in (q, k, v))
            if dropout_p > 0.0:
                out = _attention_with_dropout(q, k, v, attn_mask, is_causal, self._dropout_mask, batch)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(batch * tgt_len, -1)
        out = self.out_proj(out).view(tgt_len, batch, self.embed_dim)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _dense_weights(self, probs: torch.Tensor, average: bool) -> torch.Tensor:
        """Every head's attention weights (batch, heads, L, S), or their mean over all heads (batch, L, S)."""
        if average:
            return reduce_from_group_(probs.sum(dim=1), self.group) / self.num_heads
        every = gather_last_dim(probs.movedim(1, -1), self.group, [self.local_heads] * self.parts)
        return every.movedim(-1, 1)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, local_heads={self.local_heads}, "
                f"batch_first={self.batch_first}, rank={self.rank} of {self.parts}")


def _each(fn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` of each input, once per distinct tensor: self-attention's one input stays one tensor."""
    out: dict[int, torch.Tensor] = {}
    for t in (query, key, value):
        if id(t) not in out:
            out[id(t)] = fn(t)
    return [out[id(query)], out[id(key)], out[id(value)]]


def _attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                            is_causal: bool, mask_of: Any, batch: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask), dropout, @ v: what torch's math kernel computes for attention with
    dropout, with the dropout mask ``mask_of(probs, batch)``."""
    scale = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    scores = (q * scale) @ (k.transpose(-2, -1) * scale)
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = getattr(torch, "_safe_softmax", torch.softmax)(scores, -1)
    return (probs * mask_of(probs, batch)) @ v
