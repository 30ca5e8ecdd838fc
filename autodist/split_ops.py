"""What each op does to a tensor split along one dimension: the split of its output, and its size
arguments for a rank's slice. Read by :class:`autodist.shard_flow.Flow`; see there.

A rule takes ``(flow, func, args, kwargs)`` and returns ``(args, kwargs, split, function)``: the arguments
for the slice, the split of the output (a list for several outputs), and a function to call instead of
``func`` (or None). It raises :class:`Unsupported` for what a slice cannot compute as the model's code asks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from autodist.shard_flow import Flow

Blocks = tuple[int, ...] | None  # full sizes of the blocks along the split dimension (None: not known yet)


class Unsupported(Exception):
    """An op the slice cannot run as the model's code asks."""


@dataclass(frozen=True)
class Split:
    dim: int  # a non-negative dimension index
    blocks: Blocks


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _unsplit_operand(flow: Flow, x: torch.Tensor, own: int, dim_is_last: bool, full: int) -> bool:
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


def broadcast_split(flow: Flow, flat: list[torch.Tensor], split_in: list[torch.Tensor],
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

def _self_split(flow: Flow, args: tuple) -> tuple[torch.Tensor, Split]:
    t = args[0]
    split = flow.split_of(t)
    if split is None:
        raise Unsupported("reads a split tensor in an argument it cannot follow")
    return t, split


def _identity(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    return args, kwargs, split, None


def _dropout_mask(flow: Flow, t: torch.Tensor, split: Split, p: float) -> torch.Tensor:
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
    t, split = _self_split(flow, args)
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
        t, split = _self_split(flow, args)
        dim = kwargs.get("dim", args[dim_arg] if len(args) > dim_arg else default)
        if dim is None or _norm(dim, t.dim()) == split.dim:
            raise Unsupported("runs along the split dimension")
        return args, kwargs, split, None

    return rule


def _transpose(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    a, b = (_norm(d, t.dim()) for d in args[1:3])
    dim = b if split.dim == a else a if split.dim == b else split.dim
    return args, kwargs, Split(dim, split.blocks), None


def _matrix_transpose(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    n = t.dim()
    swap = {n - 1: n - 2, n - 2: n - 1} if n >= 2 else {}
    return args, kwargs, Split(swap.get(split.dim, split.dim), split.blocks), None


def _permute(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    dims = [_norm(d, t.dim()) for d in (kwargs.get("dims") or dims)]
    return args, kwargs, Split(dims.index(split.dim), split.blocks), None


def _unsqueeze(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    at = _norm(kwargs.get("dim", args[1] if len(args) > 1 else 0), t.dim() + 1)
    return args, kwargs, Split(split.dim + (at <= split.dim), split.blocks), None


def _squeeze(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    full = flow.full_shape(t, split)
    if dims is None:  # squeeze the dimensions one process sees as 1, not those a thin slice happens to have
        dims = tuple(i for i, n in enumerate(full) if n == 1)
        args, kwargs = (t, dims), {}
    dims = [_norm(d, t.dim()) for d in (dims if isinstance(dims, (tuple, list)) else [dims])]
    dims = [d for d in dims if full[d] == 1]
    if split.dim in dims:
        raise Unsupported("removes the split dimension")
    return args, kwargs, Split(split.dim - sum(d < split.dim for d in dims), split.blocks), None


def _shape_arg(args: tuple, kwargs: dict, key: str = "shape") -> list[int]:
    if key in kwargs:
        return list(kwargs[key])
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0])
    return list(rest)


def _resolve(shape: list[int], numel: int) -> list[int] | None:
    shape = [int(n) for n in shape]
    known = math.prod(n for n in shape if n != -1)
    if shape.count(-1) > 1 or known == 0:
        return None
    if -1 in shape:
        if numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    return shape if math.prod(shape) == numel else None


def _groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Dimensions of ``a`` and of ``b`` (same number of elements) that map onto each other, size-1 ones
    left out: e.g. (2, 6) -> (2, 3, 2) gives [([0], [0]), ([1], [1, 2])]."""
    ia = [i for i, n in enumerate(a) if n != 1]
    ib = [i for i, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ins, outs, pa, pb = [ia[i]], [ib[j]], a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(ia[i])
                pa *= a[ia[i]]
                i += 1
            else:
                outs.append(ib[j])
                pb *= b[ib[j]]
                j += 1
        groups.append((ins, outs))
    return groups


def _reshape_full(flow: Flow, t: torch.Tensor, split: Split, full_in: list[int],
                  target: list[int]) -> tuple[list[int], Split, tuple[int, ...] | None]:
    """For one process's reshape ``full_in -> target``: the slice's target shape, the output split, and the
    blocks this decides for the input (planning, when they were not known)."""
    try:
        groups = _groups(full_in, target)
    except IndexError:
        raise Unsupported(f"from {full_in} to {target} is not a reshape") from None
    ins, outs = next((g for g in groups if split.dim in g[0]), ([split.dim], []))
    if ins[0] != split.dim:
        raise Unsupported(f"merges the split dimension {split.dim} under dimension {ins[0]} ({full_in} -> "
                          f"{target}): a rank's slice would not be a contiguous part of the result")
    parts, size = flow.parts, full_in[split.dim]
    blocks, decided = split.blocks, None
    if blocks is None:  # planning: the first reshape of a layer's output says how it is laid out
        lead = target[outs[0]]
        if len(outs) >= 2 and lead % parts and lead < size and size % lead == 0:
            blocks = decided = (size // lead,) * lead  # (3C) -> (3, heads, head_dim): three blocks
        else:
            blocks = decided = (size,)
    local = list(target)
    if len(blocks) == 1:
        out = outs[0]
    elif ins == [split.dim] and outs and target[outs[0]] == size:
        out = outs[0]  # passes through whole: keeps its blocks
        local[out] = flow.local_width(blocks)
        return local, Split(out, blocks), decided
    elif len(set(blocks)) == 1 and len(outs) >= 2 and target[outs[0]] == len(blocks):
        out = outs[1]  # (3C) -> (3, heads, head_dim): the heads are split, each of the three on its own
    else:
        raise Unsupported(f"reshapes a dimension split in blocks {list(blocks)} to {target}")
    if target[out] % parts:
        raise Unsupported(f"gives dimension {out} of size {target[out]}, which does not divide by {parts} "
                          f"(heads that do not divide by mp)")
    local[out] = target[out] // parts
    return local, Split(out, (target[out],)), decided


def _reshape(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    if len(args) == 2 and isinstance(args[1], torch.dtype) or "dtype" in kwargs:
        raise Unsupported("reinterprets a split tensor's dtype")
    requested = _shape_arg(args, kwargs)
    local, out_split = _reshape_target(flow, t, split, requested)
    return (t, local), {}, out_split, None


def _reshape_target(flow: Flow, t: torch.Tensor, split: Split, requested: list[int]) -> tuple[list[int], Split]:
    full_in = flow.full_shape(t, split)
    target = _resolve(requested, math.prod(full_in))
    if target is not None:  # sizes of the model (view(B, T, n_head, head_dim)), or -1 for the rest
        local, out_split, decided = _reshape_full(flow, t, split, full_in, target)
    else:  # sizes read from the slice itself (view(*x.shape[:-1], -1) or y.size(-1))
        local_target = _resolve(requested, t.numel())
        if local_target is None or not flow.local:
            raise Unsupported(f"to {requested} fits neither the tensor nor its slice")
        groups = _groups(list(t.shape), local_target)
        outs = next((g[1] for g in groups if split.dim in g[0]), [])
        if not outs:
            raise Unsupported(f"to {requested}: cannot tell where the split dimension goes")
        target = list(local_target)
        target[outs[0]] = local_target[outs[0]] * flow.full_size(t, split) // t.shape[split.dim]
        local, out_split, decided = _reshape_full(flow, t, split, full_in, target)
        if local != local_target:
            raise Unsupported(f"to {requested}: the slice's shape {local_target} is not the slice of {target}")
    if decided is not None:
        flow.decide([t], decided)
    return local, out_split


def _flatten(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    start = _norm(kwargs.get("start_dim", args[1] if len(args) > 1 else 0), t.dim())
    end = _norm(kwargs.get("end_dim", args[2] if len(args) > 2 else -1), t.dim())
    full = flow.full_shape(t, split)
    target = full[:start] + [math.prod(full[start:end + 1])] + full[end + 1:]
    local, out_split = _reshape_target(flow, t, split, target)
    return (t, local), {}, out_split, torch.Tensor.reshape


def _unflatten(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    dim = _norm(kwargs.get("dim", args[1]), t.dim())
    sizes = list(kwargs.get("sizes", args[2] if len(args) > 2 else None))
    full = flow.full_shape(t, split)
    target = full[:dim] + sizes + full[dim + 1:]
    if -1 in sizes:
        known = math.prod(n for n in sizes if n != -1)
        whole = full[dim] if _resolve(sizes, full[dim]) is not None else t.shape[dim] * full[dim] // t.shape[dim]
        target[dim + sizes.index(-1)] = whole // known
    local, out_split = _reshape_target(flow, t, split, target)
    return (t, local), {}, out_split, torch.Tensor.reshape


def _expand(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    sizes = _shape_arg(args, kwargs, "size")
    lead = len(sizes) - t.dim()
    dim = split.dim + lead
    if sizes[dim] not in (-1, t.shape[split.dim], flow.full_size(t, split)):
        raise Unsupported(f"to {sizes} changes the split dimension")
    sizes[dim] = -1
    return (t, sizes), {}, Split(dim, split.blocks), None


def _pieces(flow: Flow, t: torch.Tensor, split: Split, sizes: list[int]) -> tuple[list[int], list[Split]]:
    """Split sizes along the split dimension, given for one process (or for the slice): the slice's sizes and
    each piece's split. Each piece must hold whole blocks."""
    full = flow.full_size(t, split)
    blocks = split.blocks
    if blocks is None:  # planning: q, k, v = c_attn(x).split(C, dim=2) says the output is three blocks
        if sum(sizes) != full:
            raise Unsupported(f"into {sizes}, which do not add up to {full}")
        if any(n % flow.parts for n in sizes):
            raise Unsupported(f"into {sizes}, which do not divide by {flow.parts}")
        flow.decide([t], tuple(sizes))
        return [n // flow.parts for n in sizes], [Split(split.dim, (n,)) for n in sizes]
    local_blocks = [b // flow.parts for b in blocks]
    own = blocks if sum(sizes) == full else local_blocks if sum(sizes) == t.shape[split.dim] else None
    if own is None:
        raise Unsupported(f"into {sizes}, which add up to neither {full} nor the slice's {t.shape[split.dim]}")
    out_sizes, out_splits, i = [], [], 0
    for n in sizes:
        taken, total = [], 0
        while total < n and i < len(blocks):
            taken.append(i)
            total += own[i]
            i += 1
        if total != n:
            raise Unsupported(f"into {sizes}, which cut across the blocks {list(blocks)}")
        out_sizes.append(sum(local_blocks[k] for k in taken))
        out_splits.append(Split(split.dim, tuple(blocks[k] for k in taken)) if taken else None)
    return out_sizes, out_splits


def _split(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    size = kwargs.get("split_size_or_sections", kwargs.get("split_size", kwargs.get("split_sizes",
                      args[1] if len(args) > 1 else None)))
    dim = _norm(kwargs.get("dim", args[2] if len(args) > 2 else 0), t.dim())
    if dim != split.dim:
        n = len(torch.Tensor.split(t, size, dim))
        return args, kwargs, [split] * n, None
    full = flow.full_size(t, split)
    if isinstance(size, int):
        sizes = [size] * (full // size) + ([full % size] if full % size else [])
    else:
        sizes = list(size)
    local, splits = _pieces(flow, t, split, sizes)
    return (t, local, dim), {}, splits, torch.Tensor.split


def _chunk(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    chunks = kwargs.get("chunks", args[1])
    dim = _norm(kwargs.get("dim", args[2] if len(args) > 2 else 0), t.dim())
    if dim != split.dim:
        n = len(torch.Tensor.chunk(t, chunks, dim))
        return args, kwargs, [split] * n, None
    full = flow.full_size(t, split)
    step = -(-full // chunks)
    sizes = [min(step, full - i) for i in range(0, full, step)]
    local, splits = _pieces(flow, t, split, sizes)
    return (t, local, dim), {}, splits, torch.Tensor.split


def _getitem(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = _self_split(flow, args)
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(isinstance(i, torch.Tensor) or isinstance(i, (list, bool)) for i in index):
        raise Unsupported("indexes a split tensor with tensors or lists")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = t.dim() - sum(i is not None for i in index if i is not Ellipsis)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    new, dim_in, dim_out, out = list(index), 0, 0, None
    for k, item in enumerate(index):
        if item is None:
            dim_out += 1
            continue
        if dim_in == split.dim:
            if isinstance(item, int):
                raise Unsupported("picks one entry of the split dimension")
            if item != slice(None):
                local, splits = _slice_pieces(flow, t, split, item)
                new[k], out = local, Split(dim_out, splits)
            else:
                out = Split(dim_out, split.blocks)
        if not isinstance(item, int):
            dim_out += 1
        dim_in += 1
    if out is None:  # the split dimension is past the index
        out = Split(dim_out + split.dim - dim_in, split.blocks)
    return (t, tuple(new)), {}, out, None


def _slice_pieces(flow: Flow, t: torch.Tensor, split: Split, item: slice) -> tuple[slice, tuple[int, ...]]:
    """A slice of the split dimension, given for one process: the slice's slice and the blocks it keeps."""
    full = flow.full_size(t, split)
    start, stop, step = item.indices(full)
    if step != 1 or stop <= start:
        raise Unsupported("slices the split dimension with a step or to nothing")
    sizes = [n for n in (start, stop - start, full - stop) if n]
    local, splits = _pieces(flow, t, split, sizes)
    middle = 1 if start else 0
    lo = local[0] if start else 0
    return slice(lo, lo + local[middle]), splits[middle].blocks  # type: ignore[union-attr,return-value]


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


def _broadcast_batch(flow: Flow, tensors: list[Any], split_in: list[torch.Tensor], out_ndim: int,
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


def _attention_dropout(flow: Flow, split: Split, bound: dict[str, Any]) -> torch.Tensor:
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
    at = _norm(dim, tensors[0].dim() + stack)
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
    RULES[_n] = _reshape
for _n in ("Tensor.flatten", "torch.flatten"):
    RULES[_n] = _flatten
for _n in ("Tensor.unflatten", "torch.unflatten"):
    RULES[_n] = _unflatten
for _n in ("Tensor.expand",):
    RULES[_n] = _expand
for _n in ("Tensor.split", "torch.split", "Tensor.split_with_sizes", "torch.split_with_sizes"):
    RULES[_n] = _split
for _n in ("Tensor.chunk", "torch.chunk"):
    RULES[_n] = _chunk
RULES["Tensor.__getitem__"] = _getitem
# rules that leave the split dimension where it is, at its size: with only these (and elementwise ops) between
# the split layers, running needs no Flow at all
PASSING = {_identity, _dropout}
for _n in ("torch.matmul", "Tensor.matmul", "Tensor.__matmul__", "torch.bmm", "Tensor.bmm"):
    RULES[_n] = _matmul
RULES["torch.scaled_dot_product_attention"] = _attention
RULES["torch.linear"] = _linear
for _n in ("torch.cat", "torch.concat", "torch.concatenate", "torch.stack"):
    RULES[_n] = _cat
