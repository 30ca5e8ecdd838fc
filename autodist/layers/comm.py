"""The communication under the MP layers, as tiny autograd Functions (Megatron-LM's mappings).

Each Function is named for what it does to a tensor that is *replicated*
(the same on every rank of the group) or *sharded* (each rank holds a slice of
the last dimension), forward and backward:

=====================  ==============================  ===============================
function               forward                         backward
=====================  ==============================  ===============================
``copy_to_group``      identity (replicated in)        all-reduce (sum) of the gradient
``reduce_from_group``  all-reduce (sum) of partials    identity
``gather_last_dim``    all-gather shards -> full       this rank's slice of the gradient
``split_last_dim``     this rank's slice               all-gather of the gradient shards
=====================  ==============================  ===============================

Every function is a no-op in a group of one rank (or with no process group at
all), works on any leading (batch) shape, and is exact: shards may be uneven
(``shard_sizes``) and are concatenated in rank order, never summed. The
collectives are looked up on ``torch.distributed`` at call time, so a test can
count them; between the ranks of one machine an all-reduce goes through
shared memory (:mod:`autodist.layers.shared_reduce`: two one-number all-reduces
around a sum in place).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from autodist.layers import shared_reduce


def shard_sizes(n: int, parts: int) -> list[int]:
    """Split ``n`` into ``parts`` widths as evenly as possible, the first ``n % parts`` one wider.

    Args:
        n: the size of the dimension being split.
        parts: the number of ranks sharing it.

    Returns:
        The width held by each rank, in rank order; they sum to ``n``.

    Example:
        >>> shard_sizes(10, 3)
        [4, 3, 3]
    """
    if parts < 1 or n < 0:
        raise ValueError(f"shard_sizes needs n >= 0 and parts >= 1, got n={n}, parts={parts}")
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def shard_range(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """The ``[lo, hi)`` bounds of ``rank``'s shard when the widths are ``sizes``.

    Example:
        >>> shard_range([4, 3, 3], 1)
        (4, 7)
    """
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def group_rank_size(group: Any = None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size.

    Args:
        group: a process group; None means the default (WORLD) group. With no
            process group initialised at all (one process, no launcher), None
            is a group of one.

    Returns:
        ``(rank, size)``.

    Example:
        >>> group_rank_size(None)   # in a plain single-process script
        (0, 1)
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of the process group "
                         f"it was asked to communicate over; build each MP layer with the group that holds it")
    return rank, size


def all_gather_cat(x: torch.Tensor, group: Any, sizes: Sequence[int], dim: int = -1) -> torch.Tensor:
    """Concatenate, along ``dim`` and in rank order, every rank's shard of widths ``sizes`` (no autograd).

    gloo's all_gather needs equal shapes, so uneven shards are padded to the
    widest and trimmed after. Every rank of ``group`` must call it.

    Args:
        x: this rank's shard: ``x.shape[dim] == sizes[rank]``, other dims equal on all ranks.
        group: the process group (None: WORLD).
        sizes: the width of every rank's shard along ``dim``.
        dim: the dimension to concatenate along.

    Returns:
        The full tensor, ``sum(sizes)`` wide along ``dim``; identical on every rank.

    Example:
        >>> full = all_gather_cat(shard, None, [4, 3, 3], dim=0)   # on each of 3 ranks
    """
    rank, size = _checked_group(group, sizes)
    _check_width(x, sizes[rank], dim, "all_gather_cat", "this rank's shard")
    if size == 1:
        return x.detach().clone()
    moved = x.detach().movedim(dim, -1)
    widest = max(sizes)
    if sizes[rank] == widest:
        padded = moved.contiguous()
    else:
        padded = torch.zeros(*moved.shape[:-1], widest, dtype=x.dtype, device=x.device)
        padded[..., :sizes[rank]] = moved
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    full = torch.cat([part[..., :width] for part, width in zip(parts, sizes)], dim=-1)
    return full.movedim(-1, dim).contiguous()


def _checked_group(group: Any, sizes: Sequence[int]) -> tuple[int, int]:
    rank, size = group_rank_size(group)
    if len(sizes) != size:
        raise ValueError(f"expected one shard width per rank of the group ({size} ranks), got {len(sizes)} "
                         f"widths {list(sizes)}; compute them with shard_sizes(n, group size)")
    return rank, size


def _check_width(x: torch.Tensor, expected: int, dim: int, op: str, what: str) -> None:
    if x.ndim == 0 or x.shape[dim] != expected:
        shape = tuple(x.shape)
        raise ValueError(f"{op} expected {what} with size {expected} in dimension {dim}, got shape {shape}")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input was used on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # autograd may hand the same gradient tensor to other consumers: reduce a copy
        total = grad.clone(memory_format=torch.contiguous_format)
        shared_reduce.all_reduce(total, ctx.group)
        return total, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward (sum of per-rank partial results); identity backward.

    ``in_place``: ``x`` is a temporary nobody reads again, so it is summed where
    it lies instead of in a copy.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, in_place: bool) -> torch.Tensor:
        if in_place:
            ctx.mark_dirty(x)
            total = x
        else:
            total = x.clone(memory_format=torch.contiguous_format)
        shared_reduce.all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather of last-dim shards forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: Sequence[int], rank: int) -> torch.Tensor:
        ctx.bounds = shard_range(sizes, rank)
        return all_gather_cat(x, group, sizes, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        lo, hi = ctx.bounds
        return grad[..., lo:hi].contiguous(), None, None, None


class _SplitLastDim(torch.autograd.Function):
    """This rank's last-dim slice forward; all-gather (concatenation) of the gradient shards backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: Sequence[int], rank: int) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        lo, hi = shard_range(sizes, rank)
        return x[..., lo:hi].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_gather_cat(grad, ctx.group, ctx.sizes, dim=-1), None, None, None


def copy_to_group(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``x`` unchanged; in backward, its gradient is summed over the ranks of ``group``.

    Use it where a replicated tensor enters per-rank computation (a
    column-split Linear): each rank's gradient is a partial sum.

    Args:
        x: a tensor that is the same on every rank of ``group``.
        group: the process group (None: WORLD).

    Returns:
        ``x`` (a view of it, through which the gradient is all-reduced).

    Example:
        >>> local_out = F.linear(copy_to_group(x, group), w_local)
    """
    if group_rank_size(group)[1] == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` (``x`` itself is left untouched); identity backward.

    Args:
        x: this rank's partial result.
        group: the process group (None: WORLD).

    Returns:
        The sum, identical on every rank.

    Example:
        >>> out = reduce_from_group(F.linear(x_local, w_local), group) + bias
    """
    if group_rank_size(group)[1] == 1:
        return x
    return _ReduceFromGroup.apply(x, group, False)


def reduce_from_group_(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """:func:`reduce_from_group` in place: ``x`` (a contiguous temporary) becomes the sum and is returned.

    Saves a copy of the partial result; the autograd graph stays exact, since
    the op that produced ``x`` does not need its own output for its backward
    (true of a matrix product).

    Example:
        >>> out = reduce_from_group_(F.linear(x_local, w_local), group)
    """
    if group_rank_size(group)[1] == 1:
        return x
    return _ReduceFromGroup.apply(x, group, x.is_contiguous())


def gather_last_dim(x: torch.Tensor, group: Any, sizes: Sequence[int]) -> torch.Tensor:
    """The full tensor from every rank's last-dim shard, concatenated in rank order.

    Args:
        x: this rank's shard, ``x.shape[-1] == sizes[rank]``.
        group: the process group (None: WORLD).
        sizes: every rank's shard width (``shard_sizes(n, group size)``).

    Returns:
        The full tensor, identical on every rank. Its gradient is assumed the
        same on every rank too (replicated computation downstream), so backward
        just keeps this rank's slice.

    Example:
        >>> full = gather_last_dim(local_out, group, shard_sizes(out_features, 3))
    """
    rank, size = _checked_group(group, sizes)
    _check_width(x, sizes[rank], -1, "gather_last_dim", "this rank's shard")
    if size == 1:
        return x
    return _GatherLastDim.apply(x, group, list(sizes), rank)


def split_last_dim(x: torch.Tensor, group: Any, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's slice of the last dimension of a replicated tensor.

    Args:
        x: the full tensor, the same on every rank, ``x.shape[-1] == sum(sizes)``.
        group: the process group (None: WORLD).
        sizes: every rank's slice width (``shard_sizes(n, group size)``).

    Returns:
        ``x[..., lo:hi]`` (contiguous). In backward, the gradient of ``x`` is
        the concatenation of every rank's slice gradient: exact, each slice of
        ``x`` having been used by exactly one rank.

    Example:
        >>> x_local = split_last_dim(x, group, shard_sizes(in_features, 2))
    """
    rank, size = _checked_group(group, sizes)
    _check_width(x, sum(sizes), -1, "split_last_dim", "the full tensor")
    if size == 1:
        return x
    return _SplitLastDim.apply(x, group, list(sizes), rank)
