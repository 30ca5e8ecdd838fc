"""What each op does to a tensor split along one dimension: the split of its output, and its size
arguments for a rank's slice (``RULES``, by the op's name). Read by :class:`autodist.mp.shard_flow.Flow`; see
there. The rule contract is in :mod:`autodist.mp.split_types`; the reshapes and the ops cutting pieces are in
:mod:`autodist.mp.split_reshape`; here are elementwise broadcasting, dropout, transposes, matmul, attention,
concatenation, and the table.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from autodist.mp.split_reshape import (chunk_rule, expand_rule, flatten_rule, getitem_rule, reshape_rule, split_rule,
                                       unflatten_rule)
from autodist.mp.split_types import FlowView, Split, Unsupported, norm, self_split

__all__ = ["RULES", "PASSING", "Split", "Unsupported", "broadcast_split"]


def _unsplit_operand(flow: FlowView, x: torch.Tensor, own: int, dim_is_last: bool, full: int) -> bool:
    """For an unsplit operand whose dimension ``own`` lines up with the split one: False when it is broadcast
    along it (size 1, or no such dimension), True when each rank must take its part of it - a per-head tensor
    held whole, such as T5's relative position bias, combined along a head dimension (never the features: a
    residual of the full width ends the region) - and raises otherwise."""
    if own < 0 or x.shape[own] == 1:
        return False
    if not dim_is_last and x.shape[own] == full:
        return True
    raise Unsupported(f"combines a split tensor with an unsplit one of shape {tuple(x.shape)} that is not "
                      f"broadcast along the split dimension")


def broadcast_split(flow: FlowView, flat: list[torch.Tensor], split_in: list[torch.Tensor],
                    out_ndim: int) -> tuple[Split, list[tuple[torch.Tensor, int]]]:
    """The output's split for tensors combined with broadcasting, and the unsplit operands each rank must
    take its part of (with their dimension to cut); raises where an unsplit operand has the split dimension's
    full width along the features (each rank would combine its slice with all of it)."""
    aligned = {(s.dim + out_ndim - t.dim()) for t in split_in for s in [flow.splits[t]]}
    if len(aligned) != 1:
        raise Unsupported("combines tensors split along different dimensions")
    dim = aligned.pop()
    blocks = {flow.splits[t].blocks for t in split_in} - {None}
    if len(blocks) > 1:
        raise Unsupported("combines tensors split in different blocks")
    first = split_in[0]
    full = flow.full_size(first, flow.splits[first])
    cut = []
    for t in flat:
        own = dim - (out_ndim - t.dim())
        if t not in flow.splits and _unsplit_operand(flow, t, own, dim == out_ndim - 1, full):
            cut.append((t, own))
    return Split(dim, blocks.pop() if blocks else None), cut


# -- rules -----------------------------------------------------------------------------------------------
# Each takes (flow, func, args, kwargs) and returns (args, kwargs, split(s) of the output(s), function to call
# instead or None). A rule raises Unsupported for what a slice cannot compute as the model's code asks.

def _identity(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    return args, kwargs, split, None


def _dropout_mask(flow: FlowView, t: torch.Tensor, split: Split, p: float) -> torch.Tensor:
    """This rank's slice of the mask one process draws for the whole of ``t`` (see :func:`dropout_mask`)."""
    from autodist.layers.dropout import dropout_mask
    from autodist.layers.shard import Shard

    if split.blocks is None:
        raise Unsupported("runs on a slice whose layout is not known")
    full = flow.full_shape(t, split)
    return dropout_mask(Shard.even(full, split.dim, split.blocks, flow.parts, flow.rank), p, like=t)


def _dropout(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    """Dropout on a slice: the slice of one process's mask (:func:`_dropout_mask`), so the split run draws the
    same mask as one process, not one per rank."""
    t, split = self_split(flow, args)
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
    if not p:
        return args, kwargs, split, None

    def run(*_: Any, **__: Any) -> torch.Tensor:
        if not training:
            return func(*args, **kwargs)
        keep = _dropout_mask(flow, t, split, p)
        return t.mul_(keep) if inplace else t * keep

    return args, kwargs, split, run


def _along(dim_arg: int, default: int | None = None) -> Callable:
    """Ops along one dimension (softmax): fine unless that dimension is the split one."""

    def rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
        t, split = self_split(flow, args)
        dim = kwargs.get("dim", args[dim_arg] if len(args) > dim_arg else default)
        if dim is None or norm(dim, t.dim()) == split.dim:
            raise Unsupported("runs along the split dimension")
        return args, kwargs, split, None

    return rule


def _transpose(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    a, b = (norm(d, t.dim()) for d in args[1:3])
    dim = b if split.dim == a else a if split.dim == b else split.dim
    return args, kwargs, Split(dim, split.blocks), None


def _matrix_transpose(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    n = t.dim()
    swap = {n - 1: n - 2, n - 2: n - 1} if n >= 2 else {}
    return args, kwargs, Split(swap.get(split.dim, split.dim), split.blocks), None


def _permute(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    dims = [norm(d, t.dim()) for d in (kwargs.get("dims") or dims)]
    return args, kwargs, Split(dims.index(split.dim), split.blocks), None


def _unsqueeze(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    at = norm(kwargs.get("dim", args[1] if len(args) > 1 else 0), t.dim() + 1)
    return args, kwargs, Split(split.dim + (at <= split.dim), split.blocks), None


def _squeeze(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    full = flow.full_shape(t, split)
    if dims is None:  # squeeze the dimensions one process sees as 1, not those a thin slice happens to have
        dims = tuple(i for i, n in enumerate(full) if n == 1)
        args, kwargs = (t, dims), {}
    dims = [norm(d, t.dim()) for d in (dims if isinstance(dims, (tuple, list)) else [dims])]
    dims = [d for d in dims if full[d] == 1]
    if split.dim in dims:
        raise Unsupported("removes the split dimension")
    return args, kwargs, Split(split.dim - sum(d < split.dim for d in dims), split.blocks), None


def _matmul(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    a, b = args[0], args[1]
    if not all(isinstance(x, torch.Tensor) and x.dim() >= 2 for x in (a, b)):
        raise Unsupported("multiplies a split vector")
    out_ndim = max(a.dim(), b.dim())
    batch = [x for x in (a, b) if x in flow.splits]
    for x in batch:
        if flow.splits[x].dim >= x.dim() - 2:
            raise Unsupported("multiplies along the split dimension")
    split, cut = _broadcast_batch(flow, [a, b], batch, out_ndim, 2)
    args, kwargs = flow.cut(args, kwargs, cut, split, batch)
    return args, kwargs, split, None


def _broadcast_batch(flow: FlowView, tensors: list[Any], split_in: list[torch.Tensor], out_ndim: int,
                     matrix_dims: int) -> tuple[Split, list[tuple[torch.Tensor, int]]]:
    """The split of a batched op's output: the split dimension must be a batch one in every split input,
    and an unsplit input broadcast along it or a per-head tensor held whole (returned, to be cut)."""
    dims = {flow.splits[x].dim + out_ndim - x.dim() for x in split_in}
    if len(dims) != 1:
        raise Unsupported("combines tensors split along different dimensions")
    dim = dims.pop()
    first = split_in[0]
    full = flow.full_size(first, flow.splits[first])
    cut = []
    for x in tensors:
        if isinstance(x, torch.Tensor) and x not in flow.splits:
            own = dim - (out_ndim - x.dim())
            if own < x.dim() - matrix_dims and _unsplit_operand(flow, x, own, False, full):
                cut.append((x, own))
    blocks = {flow.splits[x].blocks for x in split_in} - {None}
    return Split(dim, blocks.pop() if len(blocks) == 1 else None), cut


def _attention(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, args)) | kwargs
    q, k, v = bound["query"], bound["key"], bound["value"]
    split_in = [x for x in (q, k, v, bound.get("attn_mask")) if isinstance(x, torch.Tensor) and x in flow.splits]
    if any(x not in flow.splits for x in (q, k, v)):
        raise Unsupported("mixes split and unsplit query, key and value")
    for x in split_in:
        if flow.splits[x].dim >= x.dim() - 2:
            raise Unsupported("runs along the split dimension (heads must be split, not sequence or features)")
    tensors = [q, k, v, bound.get("attn_mask")]
    split, cut = _broadcast_batch(flow, tensors, split_in, q.dim(), 2)
    out = Split(split.dim, flow.splits[q].blocks)
    args, kwargs = flow.cut(args, kwargs, cut, out, split_in)
    bound = dict(zip(names, args)) | kwargs
    if not bound.get("dropout_p", 0.0):
        return args, kwargs, out, None
    if bound.get("enable_gqa") or q.shape[:-2] != k.shape[:-2]:
        raise Unsupported("with dropout and grouped key/value heads: set the attention dropout to 0 or repeat "
                          "the key/value heads before the call")
    return args, kwargs, out, lambda *_, **__: _attention_dropout(flow, out, bound)


def _attention_dropout(flow: FlowView, split: Split, bound: dict[str, Any]) -> torch.Tensor:
    """Attention with dropout on the local heads, as torch's math kernel computes it (softmax(q k^T scale +
    mask), dropout, @ v), the dropout mask being this rank's heads of one process's mask: on CPU, where one
    process runs this kernel too, the same result; on GPU, whose fused kernels draw their masks otherwise,
    the same distribution."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    scale = bound.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    scores = (q * math.sqrt(scale)) @ (k.transpose(-2, -1) * math.sqrt(scale))
    if bound.get("is_causal"):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, float("-inf"))
        scores = scores + mask
    probs = getattr(torch, "_safe_softmax", torch.softmax)(scores, -1)
    return (probs * _dropout_mask(flow, probs, split, bound["dropout_p"])) @ v


def _linear(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    x = args[0]
    split = flow.split_of(x)
    if split is None or split.dim == x.dim() - 1 or any(a in flow.splits for a in args[1:] if
                                                         isinstance(a, torch.Tensor)):
        raise Unsupported("multiplies along the split dimension outside a split layer")
    return args, kwargs, split, None


def _cat(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    # an empty 1-D tensor joins nothing (torch.cat skips it): a cache that starts empty
    tensors = [x for x in kwargs.get("tensors", args[0]) if not (x.dim() == 1 and x.numel() == 0)]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if any(x not in flow.splits for x in tensors):
        raise Unsupported("joins split and unsplit tensors")
    splits = {flow.splits[x] for x in tensors}
    if len(splits) != 1:
        raise Unsupported("joins tensors split differently")
    split = splits.pop()
    stack = getattr(func, "__name__", "") == "stack"
    at = norm(dim, tensors[0].dim() + stack)
    if not stack and at == split.dim:
        raise Unsupported("joins along the split dimension")
    return args, kwargs, Split(split.dim + (stack and at <= split.dim), split.blocks), None


RULES: dict[str, Callable] = {}
for _n in ("Tensor.contiguous", "Tensor.clone", "torch.clone", "Tensor.float", "Tensor.half", "Tensor.bfloat16",
           "Tensor.double", "Tensor.to", "Tensor.type_as", "Tensor.detach", "torch.detach", "Tensor.requires_grad_"):
    RULES[_n] = _identity
for _n in ("F.dropout", "torch.dropout", "Tensor.dropout"):
    RULES[_n] = _dropout
for _n in ("F.softmax", "F.log_softmax", "Tensor.softmax", "Tensor.log_softmax", "torch.softmax",
           "torch.log_softmax", "torch._softmax"):
    RULES[_n] = _along(1)
for _n in ("Tensor.transpose", "torch.transpose", "Tensor.swapaxes", "Tensor.swapdims", "torch.swapaxes"):
    RULES[_n] = _transpose
for _n in ("Tensor.t", "torch.t", "Tensor.mT"):
    RULES[_n] = _matrix_transpose
for _n in ("Tensor.permute", "torch.permute"):
    RULES[_n] = _permute
for _n in ("Tensor.unsqueeze", "torch.unsqueeze"):
    RULES[_n] = _unsqueeze
for _n in ("Tensor.squeeze", "torch.squeeze"):
    RULES[_n] = _squeeze
for _n in ("Tensor.view", "Tensor.reshape", "torch.reshape"):
    RULES[_n] = reshape_rule
for _n in ("Tensor.flatten", "torch.flatten"):
    RULES[_n] = flatten_rule
for _n in ("Tensor.unflatten", "torch.unflatten"):
    RULES[_n] = unflatten_rule
for _n in ("Tensor.expand",):
    RULES[_n] = expand_rule
for _n in ("Tensor.split", "torch.split", "Tensor.split_with_sizes", "torch.split_with_sizes"):
    RULES[_n] = split_rule
for _n in ("Tensor.chunk", "torch.chunk"):
    RULES[_n] = chunk_rule
RULES["Tensor.__getitem__"] = getitem_rule
# rules that leave the split dimension where it is, at its size: with only these (and elementwise ops) between
# the split layers, running needs no Flow at all
PASSING = {_identity, _dropout}
for _n in ("torch.matmul", "Tensor.matmul", "Tensor.__matmul__", "torch.bmm", "Tensor.bmm"):
    RULES[_n] = _matmul
RULES["torch.scaled_dot_product_attention"] = _attention
RULES["torch.linear"] = _linear
for _n in ("torch.cat", "torch.concat", "torch.concatenate", "torch.stack"):
    RULES[_n] = _cat
