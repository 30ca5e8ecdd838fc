"""Split rules for the ops that regroup dimensions: ``view`` / ``reshape`` / ``flatten`` / ``unflatten`` /
``expand``, and the ops that cut a tensor into pieces: ``split`` / ``chunk`` / indexing.

A reshape keeps a rank's slice a contiguous part of the result only when the split dimension stays
outermost in its group of dimensions; the first reshape of a layer's output also says how the output is
laid out (``(3C) -> (3, heads, head_dim)``: three blocks, q, k and v). Pieces must not cut across blocks.
"""
from __future__ import annotations

import math

import torch

from autodist.mp.split_types import FlowView, Split, Unsupported, norm, self_split


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


def _groups(a: list[int], b: list[int], keep: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Dimensions of ``a`` and of ``b`` (same number of elements) that map onto each other, size-1 ones
    left out but ``a``'s dimension ``keep`` (a split dimension of one on this rank: a single head): e.g.
    (2, 6) -> (2, 3, 2) gives [([0], [0]), ([1], [1, 2])]."""
    ia = [i for i, n in enumerate(a) if n != 1 or i == keep]
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


def _reshape_full(flow: FlowView, t: torch.Tensor, split: Split, full_in: list[int],
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


def reshape_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    if len(args) == 2 and isinstance(args[1], torch.dtype) or "dtype" in kwargs:
        raise Unsupported("reinterprets a split tensor's dtype")
    requested = _shape_arg(args, kwargs)
    local, out_split = _reshape_target(flow, t, split, requested)
    return (t, local), {}, out_split, None


def _reshape_target(flow: FlowView, t: torch.Tensor, split: Split, requested: list[int]) -> tuple[list[int], Split]:
    full_in = flow.full_shape(t, split)
    target = _resolve(requested, math.prod(full_in))
    if target is not None:  # sizes of the model (view(B, T, n_head, head_dim)), or -1 for the rest
        local, out_split, decided = _reshape_full(flow, t, split, full_in, target)
    else:  # sizes read from the slice itself (view(*x.shape[:-1], -1) or y.size(-1))
        local_target = _resolve(requested, t.numel())
        if local_target is None or not flow.local:
            raise Unsupported(f"to {requested} fits neither the tensor nor its slice")
        try:  # the slice's split dimension kept where it is one wide (Hugging Face's repeat_kv of one kv head)
            groups = _groups(list(t.shape), local_target, keep=split.dim)
        except IndexError:
            groups = []
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


def flatten_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    start = norm(kwargs.get("start_dim", args[1] if len(args) > 1 else 0), t.dim())
    end = norm(kwargs.get("end_dim", args[2] if len(args) > 2 else -1), t.dim())
    full = flow.full_shape(t, split)
    target = full[:start] + [math.prod(full[start:end + 1])] + full[end + 1:]
    local, out_split = _reshape_target(flow, t, split, target)
    return (t, local), {}, out_split, torch.Tensor.reshape


def unflatten_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    dim = norm(kwargs.get("dim", args[1]), t.dim())
    sizes = list(kwargs.get("sizes", args[2] if len(args) > 2 else None))
    full = flow.full_shape(t, split)
    target = full[:dim] + sizes + full[dim + 1:]
    if -1 in sizes:
        known = math.prod(n for n in sizes if n != -1)
        whole = full[dim] if _resolve(sizes, full[dim]) is not None else t.shape[dim] * full[dim] // t.shape[dim]
        target[dim + sizes.index(-1)] = whole // known
    local, out_split = _reshape_target(flow, t, split, target)
    return (t, local), {}, out_split, torch.Tensor.reshape


def expand_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    sizes = _shape_arg(args, kwargs, "size")
    lead = len(sizes) - t.dim()
    dim = split.dim + lead
    if sizes[dim] not in (-1, t.shape[split.dim], flow.full_size(t, split)):
        raise Unsupported(f"to {sizes} changes the split dimension")
    sizes[dim] = -1
    return (t, sizes), {}, Split(dim, split.blocks), None


def _pieces(flow: FlowView, t: torch.Tensor, split: Split, sizes: list[int]) -> tuple[list[int], list[Split]]:
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


def split_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    size = kwargs.get("split_size_or_sections", kwargs.get("split_size", kwargs.get("split_sizes",
                      args[1] if len(args) > 1 else None)))
    dim = norm(kwargs.get("dim", args[2] if len(args) > 2 else 0), t.dim())
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


def chunk_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
    chunks = kwargs.get("chunks", args[1])
    dim = norm(kwargs.get("dim", args[2] if len(args) > 2 else 0), t.dim())
    if dim != split.dim:
        n = len(torch.Tensor.chunk(t, chunks, dim))
        return args, kwargs, [split] * n, None
    full = flow.full_size(t, split)
    step = -(-full // chunks)
    sizes = [min(step, full - i) for i in range(0, full, step)]
    local, splits = _pieces(flow, t, split, sizes)
    return (t, local, dim), {}, splits, torch.Tensor.split


def getitem_rule(flow, func, args, kwargs):  # type: ignore[no-untyped-def]
    t, split = self_split(flow, args)
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


def _slice_pieces(flow: FlowView, t: torch.Tensor, split: Split, item: slice) -> tuple[slice, tuple[int, ...]]:
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
