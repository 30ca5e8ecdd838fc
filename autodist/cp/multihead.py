"""``nn.MultiheadAttention`` under ``cp=K``: ``F.multi_head_attention_forward`` computed over the whole sequence.

torch's ``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer``, ``nn.Transformer``, which call it) runs
``F.multi_head_attention_forward`` on ``(tokens, batch, embed)`` tensors: the projections, the heads, the
attention and the output projection. Under cp each rank holds its tokens, so the call is computed here as it
is there, with the attention over the whole sequence: the projections and the heads per token as they are,
the attention through :func:`~autodist.layers.context.context_attention` (or, where the caller asks for the
attention weights, this rank's rows of them over the whole sequence's keys, gathered), the output projection
per token. Its masks are read as the routing reads a model's (:mod:`autodist.cp.masks`): ``key_padding_mask``
(True or ``-inf`` at padding) from the whole batch's, which every rank of the group holds (it must be the
batch's, or made from it), and ``attn_mask`` (``nn.Transformer.generate_square_subsequent_mask``, boolean or
``-inf``) taken where it is, over this rank's tokens, the causal mask or none; the ``is_causal`` hint is
trusted where torch trusts it. Refused: extra keys (``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``),
keys that are not the batch's own tokens (cross-attention, a memory), and dropout in training.

Example:
    >>> layer = nn.TransformerEncoderLayer(64, 4, batch_first=True, dropout=0.0)
    >>> model, loader = autodist.parallelize(nn.TransformerEncoder(layer, 2), loader, cp=2)   # as it is
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from autodist.cp.masks import Masks
from autodist.layers.context import attention_mask, context_attention


def multihead(context: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim: int,
              num_heads: int, in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
              bias_k: torch.Tensor | None, bias_v: torch.Tensor | None, add_zero_attn: bool, dropout_p: float,
              out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None, training: bool = True,
              key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
              attn_mask: torch.Tensor | None = None, use_separate_proj_weight: bool = False,
              q_proj_weight: torch.Tensor | None = None, k_proj_weight: torch.Tensor | None = None,
              v_proj_weight: torch.Tensor | None = None, static_k: torch.Tensor | None = None,
              static_v: torch.Tensor | None = None, average_attn_weights: bool = True,
              is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward``'s result for this rank's tokens, attending over the whole sequence;
    ``context`` is the model's routing (:class:`autodist.cp.forward.Context`, which calls this)."""
    cut, name = context.cut, context.name
    parts, held, split = cut.parts, cut.held, cut.split
    if bias_k is not None or bias_v is not None or add_zero_attn or static_k is not None or static_v is not None:
        raise NotImplementedError(f"cp={parts}: {name}'s nn.MultiheadAttention adds keys of its own (bias_k, "
                                  f"add_zero_attn or static_k), which are not the batch's tokens: not split along "
                                  f"the sequence; use cp=1 for this model")
    if dropout_p and training:
        raise NotImplementedError(f"cp={parts}: {name}'s nn.MultiheadAttention has dropout={dropout_p} in training, "
                                  f"which would draw a different mask than one process: set its dropout to 0 "
                                  f"under cp")
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    if query.shape[0] != held or key.shape[0] != held:
        raise NotImplementedError(
            f"cp={parts}: {name}'s nn.MultiheadAttention has {query.shape[0]} queries and {key.shape[0]} keys, but "
            f"this rank holds {held} tokens of the sequence: cp splits self-attention over the batch's own tokens "
            f"only (not cross-attention over a memory)")
    tokens, rows, _ = query.shape
    head = embed_dim // num_heads
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = in_proj_weight.chunk(3)
    biases = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
    q, k, v = (F.linear(x, w, b).view(tokens, rows, num_heads, head).permute(1, 2, 0, 3)
               for x, w, b in zip((query, key, value), weights, biases))  # each (rows, heads, tokens, head)
    padding = None if key_padding_mask is None else _padding(context, key_padding_mask)
    if is_causal and key_padding_mask is None and not need_weights:
        causal = True  # torch trusts the hint here and drops attn_mask
    elif attn_mask is None:
        causal = False
    else:
        local = attn_mask.view(rows, num_heads, tokens, tokens) if attn_mask.dim() == 3 else attn_mask
        allowed = ~local if local.dtype == torch.bool else local
        causal, _ = Masks(cut, name).decide(allowed, False, context.group, query.device)
    if need_weights:
        out, scores = _with_weights(context, q, k, v, causal, padding)
        scores = scores.mean(1) if average_attn_weights else scores
    else:
        if padding is None and attn_mask is not None and not causal:
            padding = torch.ones(rows, split.length, dtype=torch.bool, device=query.device)
        out, scores = context_attention(q, k, v, split=split, group=context.group, causal=causal,
                                        key_padding=padding), None
    context.routed += 1
    out = F.linear(out.permute(2, 0, 1, 3).reshape(tokens, rows, embed_dim), out_proj_weight, out_proj_bias)
    if not batched:
        return out.squeeze(1), None if scores is None else scores.squeeze(0)
    return out, scores


def _padding(context: Any, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """The whole sequence's keys, True at tokens, from the batch's ``key_padding_mask`` (True or -inf at padding)."""
    whole = context.wholes.get(id(key_padding_mask))
    if whole is None:
        raise NotImplementedError(
            f"cp={context.cut.parts}: {context.name}'s nn.MultiheadAttention got a key_padding_mask (shape "
            f"{list(key_padding_mask.shape)}) that is not the batch's, nor made from it, so the whole sequence's "
            f"padding cannot be read from it; put the padding mask into the batch the loader hands out")
    return ~whole if whole.dtype == torch.bool else whole == 0


def _with_weights(context: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the attention and of its weights over the whole sequence's keys (gathered, each
    differentiable), as ``F.multi_head_attention_forward`` computes them where the weights are asked for."""
    split, group = context.cut.split, context.group
    keys, values = split.gather(k, group, dim=-2), split.gather(v, group, dim=-2)
    scores = (q * math.sqrt(1.0 / q.shape[-1])) @ keys.transpose(-2, -1)
    mine = split.positions(context.cut.rank).to(q.device)
    mask = attention_mask(mine, torch.arange(split.length, device=q.device), causal=causal, window=None,
                          documents=None, key_padding=padding)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ values, weights
