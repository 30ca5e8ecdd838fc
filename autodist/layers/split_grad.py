"""Norms over a model split by ``mp=K``: ``clip_grad_norm_`` and ``get_total_norm`` see the whole model.

Each rank of a model-parallel group holds its shard of every split parameter, and that shard's ``.grad`` is
the whole gradient of the shard: reading it, arithmetic and ``optimizer.step`` need nothing from the other
ranks. Only a norm over the whole model does. torch takes it as the norm of the stack of every gradient's
norm, and on one rank that stack holds the norms of its shards only (0.301 and 0.330 on two ranks where one
process gets 0.4275): each rank would clip by its own factor and the parameters every rank holds whole would
drift apart.

So after each backward that reaches a split parameter, its ``.grad`` is marked: a :class:`SplitGrad` is the
same tensor (no copy), whose class knows the group the parameter is split over (a post-accumulate-grad hook,
nothing sent). Every operation on it runs as on a plain tensor and returns plain tensors; only its norm over
all elements is a :class:`SplitNorm`, the shard's norm (a plain value to read). ``torch.stack`` of norms
holding one gives :class:`StackedNorms`, and the norm of that is the model's: the split gradients' parts
summed over the group (their p-th powers; the maximum for inf), the norms of gradients every rank holds
counted once, in one all-reduce of one number. A loop that never takes such a norm sends nothing more.

Example:
    >>> mark_split(layer.weight, group)        # done by the MP layers for every split parameter
    >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm, on every rank
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm)


def _plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def mark_split(p: nn.Parameter, group: Any, counted: bool = True, inside: tuple[Any] | None = None) -> None:
    """From now on ``p.grad`` is a :class:`SplitGrad` over ``group`` after every backward that reaches ``p``.

    ``counted``: whether this rank's part counts in a norm over the group; False where another rank of the group
    holds the same part (a parameter every stage of a pipeline holds counts on one stage). A second call marks
    the parameter anew (a pipeline over model-parallel layers: one group for both). ``inside``: None where the
    group lies across the data-parallel ranks (mp, pp: each data-parallel rank holds the same parts); for experts
    placed over data-parallel ranks (ep), ``(replicas, joins, across)``: the group of the ranks holding the same
    experts in the other expert groups (None in it: there are none), which a norm over sharded gradients counts
    once; whether the sum over ``group`` joins the group across the data-parallel ranks here (on the first
    model-parallel rank); and that group, ``(mp's or pp's group,)``, or None where there is none. A parameter every
    rank of ``group`` holds alike may be marked so too (``counted`` on one of them): every rank then takes part in
    the sum over ``group``, whether or not its experts got a gradient.

    Example:
        >>> mark_split(self.weight, group)
    """
    fresh = getattr(p, "split_over", None) is None
    p.split_over = (group,)  # a tuple: group None is the whole world
    p.split_counted = counted
    p.split_inside = inside
    if p.requires_grad and fresh:
        p.register_post_accumulate_grad_hook(_mark)


def mark_inside(p: nn.Parameter, replicas: Any) -> None:
    """``p`` (held whole, its gradient sharded under ``shard="gradients"``) trains beside experts placed over the
    data-parallel ranks (see :func:`mark_split`'s ``inside``): a norm over the sharded gradients takes the path
    that counts the experts on every rank, whether or not this rank's experts got a gradient this step."""
    p.split_inside = (replicas,)


def split_inside(p: torch.Tensor) -> tuple[Any] | None:
    """``(replicas,)`` for a parameter of a model with experts placed over the data-parallel ranks (ep)."""
    return getattr(p, "split_inside", None)


def split_group(p: torch.Tensor) -> tuple[Any] | None:
    """``(group,)`` for a parameter split over ``group`` by an MP layer; None for one every rank holds whole."""
    return getattr(p, "split_over", None)


def split_counted(p: torch.Tensor) -> bool:
    """Whether this rank's part of a split parameter counts in a norm over its group (see :func:`mark_split`)."""
    return getattr(p, "split_counted", True)


def mark_grad(p: nn.Parameter) -> None:
    """``p.grad`` marked as a split parameter's (what each backward that reaches ``p`` does) where ``p`` is one: for
    a gradient set outside backward (zeros where another rank's rows gave the only gradient)."""
    if getattr(p, "split_over", None) is not None:
        _mark(p)


def _mark(p: nn.Parameter) -> None:
    grad = p.grad
    if grad is not None and type(grad) is torch.Tensor:  # a sharded gradient (shard="gradients") knows the split
        p.grad = as_split(grad, p.split_over[0], p.split_counted, getattr(p, "split_inside", None))


def as_split(grad: torch.Tensor, group: Any, counted: bool = True, inside: tuple[Any] | None = None) -> "SplitGrad":
    """``grad`` (the same memory) as the gradient of a parameter split over ``group`` (see :func:`mark_split`)."""
    t = grad.as_subclass(SplitGrad)
    t.group, t.counted, t.inside = group, counted, inside
    return t


class SplitGrad(torch.Tensor):
    """The gradient of a parameter split over ``group``: a plain tensor, except that its norm over all elements
    is a :class:`SplitNorm` (see the module docstring)."""

    group: Any
    counted: bool
    inside: tuple[Any] | None

    def around(self, other: torch.Tensor) -> "SplitGrad":
        """``other`` (a tensor that takes this gradient's place, as a view of a bucket) marked as this one is."""
        return as_split(other, self.group, self.counted, self.inside)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _plain(func, args, kwargs)
        if func in _NORMS and isinstance(args[0], SplitGrad):
            ord = _whole_order(func, args, kwargs)
            return out if ord is None else SplitNorm.of(out, ord, args[0].group, args[0].counted, args[0].inside)
        if func is torch._foreach_norm:
            ord = _whole_order(func, args, kwargs)
            if ord is not None:
                return [SplitNorm.of(n, ord, g.group, g.counted, g.inside) if isinstance(g, SplitGrad) else n
                        for n, g in zip(out, args[0])]
        return out


def _whole_order(func: Any, args: tuple, kwargs: dict) -> float | None:
    """The order of a norm over all of a tensor's elements, as a float; None for any other norm."""
    name = "ord" if func in (torch.linalg.vector_norm, torch._foreach_norm) else "p"
    value = kwargs.get(name, args[1] if len(args) > 1 else (2.0 if name == "ord" else "fro"))
    if len(args) > 2 or kwargs.get("dim") is not None or kwargs.get("keepdim") or kwargs.get("dtype") is not None:
        return None
    if value is None or value == "fro":
        return 2.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class SplitNorm(torch.Tensor):
    """The norm of this rank's shard of a split gradient: a plain value to read; stacked with other norms, its
    part of the model's norm over ``group``."""

    ord: float
    group: Any
    counted: bool
    inside: tuple[Any] | None  # see mark_split

    @staticmethod
    def of(value: torch.Tensor, ord: float, group: Any, counted: bool = True,
           inside: tuple[Any] | None = None) -> "SplitNorm":
        t = value.as_subclass(SplitNorm)
        t.ord, t.group, t.counted, t.inside = ord, group, counted, inside
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _plain(func, args, kwargs)
        if func is torch.Tensor.to and isinstance(args[0], SplitNorm) and out is not args[0]:
            return SplitNorm.of(out, args[0].ord, args[0].group, args[0].counted, args[0].inside)
        if func is torch.stack and len(args) == 1 and not kwargs.get("dim") and not kwargs.get("out"):
            return StackedNorms.of(out, list(args[0]))
        return out


class StackedNorms(torch.Tensor):
    """A stack of gradient norms, some of them parts of split gradients' norms: its norm of their order is
    the model's norm, the same on every rank of the group (one all-reduce; every rank must take it)."""

    split: list[bool | None]  # per norm: a split gradient's part, counted here or not; None for a whole one
    ord: float
    group: Any
    groups: list[Any]  # per norm: the group its part is split over (None for a whole one), where they differ
    inside: list[bool]  # per norm: split over a group inside the data-parallel ranks (ep's experts)
    joins: list[bool]  # per such norm: its group's sum joins the group across the data-parallel ranks here
    across: list[Any]  # that group, where the marks name it (one at most)

    @staticmethod
    def of(stacked: torch.Tensor, norms: Sequence[torch.Tensor]) -> "StackedNorms":
        parts = [n for n in norms if isinstance(n, SplitNorm)]
        if any(n.ord != parts[0].ord for n in parts):
            raise RuntimeError("norms of gradients split over the ranks, of different orders, cannot be stacked into "
                               "one norm")
        t = stacked.as_subclass(StackedNorms)
        t.split, t.ord, t.group = [n.counted if isinstance(n, SplitNorm) else None for n in norms], parts[0].ord, \
            parts[0].group
        t.groups = [n.group if isinstance(n, SplitNorm) else None for n in norms]
        t.inside = [isinstance(n, SplitNorm) and n.inside is not None for n in norms]
        marked = [n.inside for n in norms if isinstance(n, SplitNorm) and n.inside is not None]
        t.joins = [isinstance(n, SplitNorm) and n.inside is not None and bool(n.inside[1]) for n in norms]
        t.across = [inside[2][0] for inside in marked if inside[1] and inside[2] is not None][:1]
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        stacked = args[0] if args else None
        if func in _NORMS and isinstance(stacked, StackedNorms) and _whole_order(func, args, kwargs) == stacked.ord:
            with torch._C.DisableTorchFunctionSubclass():
                if stacked.across or any(g is not stacked.group for g, split in zip(stacked.groups, stacked.split)
                                         if split is not None):
                    return _over_groups(stacked, stacked.split, stacked.groups, stacked.inside, stacked.joins,
                                        stacked.ord, stacked.across)
                first = first_rank(stacked.group)  # a gradient every rank holds whole counts there only
                return whole_norm(stacked, [first if split is None else split for split in stacked.split], stacked.ord,
                                  stacked.group)
        return _plain(func, args, kwargs)


def _over_groups(norms: torch.Tensor, split: list[bool | None], groups: list[Any], inside: list[bool],
                 joins: list[bool], ord: float, named: Sequence[Any] = ()) -> torch.Tensor:
    """The norm of gradients split over two groups at once: a group across the data-parallel ranks (``mp``'s or
    ``pp``'s: attention split over the model-parallel ranks, blocks over the stages) and one inside them (``ep``'s:
    experts placed over data-parallel ranks). The parts counted over the group inside are summed over it first
    (each rank's experts; a gradient its ranks hold alike, on one of them), then that sum joins the counted parts
    of the group across, on the ranks whose marks say so (the first model-parallel rank; every stage's, each
    holding its own blocks' experts), summed over it; the whole gradients, the same on every rank, are added
    here; ``named``: the group across, as the marks inside name it (the parts across may all be marked inside: a
    pipeline stage's blocks beside experts held as modules). One order on every rank: inside, then across."""
    norms = norms.detach().reshape(-1)
    across = {id(g): g for g, s, i in zip(groups, split, inside) if s is not None and not i}
    within = {id(g): g for g, s, i in zip(groups, split, inside) if s is not None and i}
    across.update({id(g): g for g in named})
    across = {k: g for k, g in across.items() if k not in within}  # ep's group may also count whole parameters
    if len(across) > 1 or len(within) > 1 or math.isinf(ord) or ord <= 0:
        raise RuntimeError(f"a norm of order {ord} over gradients split over {len(across) + len(within)} groups is "
                           f"not built: clip_grad_norm_ and get_total_norm take finite orders > 0 over the "
                           f"model-parallel (or pipeline) and the expert groups together")

    def powers(keep: list[bool]) -> torch.Tensor:
        mask = torch.tensor(keep, dtype=torch.bool, device=norms.device)
        return torch.where(mask, norms, torch.zeros_like(norms)).pow(ord).sum()

    total = norms.new_zeros(())
    for g in within.values():
        total = powers([h is g and bool(s) for s, h in zip(split, groups)])
        dist.all_reduce(total, group=g)
    if across:
        g = next(iter(across.values()))
        value = powers([s is not None and bool(s) and h is g for s, h in zip(split, groups)])
        if any(joins):  # the sum inside joins here (only norms inside are marked so)
            value = value + total
        dist.all_reduce(value, group=g)
        total = value
    total = total + powers([s is None for s in split])
    return total if ord == 1.0 else total.pow(1.0 / ord)


def first_rank(group: Any) -> bool:
    """Whether this rank is the first of ``group`` (None: the world)."""
    return (dist.get_rank(group) if group is not None else dist.get_rank()) == 0


def whole_norm(norms: torch.Tensor, here: Sequence[bool], ord: float, group: Any) -> torch.Tensor:
    """The norm of order ``ord`` of a vector spread over the ranks of ``group``: ``norms`` are the norms of the
    pieces this rank holds, ``here`` says which of them this rank counts (a piece several ranks hold alike
    counts on one of them). One all-reduce; inf and -inf keep a NaN (gloo's max would drop it).

    Example:
        >>> whole_norm(torch.stack([shard_norm, bias_norm]), [True, first_rank(group)], 2.0, mp_group)
    """
    norms = norms.detach().reshape(-1)
    if ord <= 0 and ord != -math.inf:
        raise RuntimeError(f"a norm of order {ord} over gradients split across the ranks is not their norm in one "
                           f"process; clip_grad_norm_ and get_total_norm give norms of order > 0, inf and -inf")
    if math.isinf(ord):
        sign = 1.0 if ord > 0 else -1.0
        if norms.numel() == 0:  # no identity in torch: a norm is >= 0, so 0 for max
            value = torch.tensor(0.0 if ord > 0 else math.inf, dtype=norms.dtype, device=norms.device)
        else:
            value = norms.max() if ord > 0 else norms.min()
        both = torch.stack([value * sign, norms.isnan().any().to(norms.dtype)]).nan_to_num(nan=-math.inf)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return torch.where(both[1] > 0, torch.nan, both[0] * sign)
    keep = torch.tensor(list(here), dtype=torch.bool, device=norms.device)
    value = torch.where(keep, norms, torch.zeros_like(norms)).pow(ord).sum()
    dist.all_reduce(value, group=group)
    return value if ord == 1.0 else value.pow(1.0 / ord)
