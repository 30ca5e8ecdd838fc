"""What ``.grad`` holds under ``shard="gradients"``: the parameter's shape, this rank's slice of the values.

After a sync each data-parallel rank keeps only its slice of the averaged gradient (a view of its part of
the reduce-scattered bucket, :mod:`autodist.sharded.scatter`). ``p.grad`` is then a :class:`ShardedGrad`:
a tensor with ``p``'s shape, dtype and device and no storage of its own, whose ``local`` is this rank's
slice (empty where the rank owns none of ``p``). It does what a training loop does to gradients, as one
process would:

* ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm``: each gradient's norm is a :class:`PartialNorm`
  (this rank's part of it); stacking them all-reduces the slices' sums of p-th powers once and gives each
  whole gradient's norm, rounded to its dtype as torch rounds it (a bfloat16 model's norm is one process's
  bit for bit), so every rank gets the global norm, and the scaling applies to each slice;
* ``clip_grad_value_``, ``zero_grad(set_to_none=False)``: elementwise, on the slice;
* ``GradScaler``'s unscale: on the slice, its inf/NaN check over the whole gradient (every rank skips alike).

Anything else (reading the values, ``p.grad.norm().item()``, arithmetic) would see 1/N of the gradient, so
it raises, naming what to use instead: never a silent per-rank answer.

Example:
    >>> p.grad = ShardedGrad(p, local=part[lo:hi], group=group)
    >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm, on every rank
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from autodist.layers.split_grad import SplitNorm, first_rank, split_counted, split_group, split_inside, whole_norm

_PASS = (torch.Tensor.requires_grad_, torch.Tensor.detach_)


def _passes(func: Any) -> bool:
    """Attribute reads (``.shape``, ``.grad_fn``) and flag changes: answered from the metadata."""
    return getattr(func, "__name__", "") in ("__get__", "__set__") or func in _PASS


def _plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class ShardedGrad(torch.Tensor):
    """A whole gradient's metadata around this rank's slice ``local`` of it (see the module docstring)."""

    local: torch.Tensor
    group: Any
    level: str  # the shard= level: "gradients" or "parameters"
    split: tuple[Any] | None  # (the model-parallel group,) where the parameter is an MP layer's shard

    @staticmethod
    def __new__(cls, like: torch.Tensor, local: torch.Tensor, group: Any, level: str = "gradients") -> "ShardedGrad":
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        t.local, t.group, t.level, t.split = local, group, level, split_group(like)
        t.counted = split_counted(like)  # where split: whether this rank's part counts (pp: one stage's root)
        t.inside = split_inside(like)  # beside experts placed over the data-parallel ranks (ep)
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"ShardedGrad(shape={tuple(self.shape)}, {self.local.numel()} of its elements on this rank; "
                f"parallelize(..., shard={self.level!r}))")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _passes(func):
            return _plain(func, args, kwargs)
        if func in (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm):
            return _norm(args[0], _ord(args, kwargs))
        if func is torch._foreach_norm:
            return [_norm(t, _ord(args, kwargs)) for t in args[0]]
        elementwise = _ELEMENTWISE.get(func)
        if elementwise is not None:
            return elementwise(*args, **kwargs)
        raise RuntimeError(_refusal(func, _level(args)))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise RuntimeError(_refusal(func, _level(args)))


def _level(args: Any) -> str:
    """The shard= level of the first sharded gradient among ``args`` (lists of them too)."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, ShardedGrad):
                return t.level
    return "gradients"


def _refusal(func: Any, level: str = "gradients") -> str:
    name = getattr(func, "__name__", str(func))
    return (f"{name} on a gradient of a model parallelized with shard={level!r}: each rank holds only its slice "
            f"of every synchronized gradient, so {name} would see 1/N of it. torch.nn.utils.clip_grad_norm_, "
            f"get_total_norm, clip_grad_value_, GradScaler and optimizer.zero_grad work on it as in one process; "
            f"to read whole gradients, use shard='optimizer' (whole gradients, the optimizer state still split)")


def _ord(args: tuple, kwargs: dict) -> float:
    """The order of a norm over all of a gradient's elements; anything else (over some dims) is refused."""
    value = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2.0))
    if len(args) > 2 or kwargs.get("dim") is not None or kwargs.get("keepdim") or kwargs.get("dtype") is not None:
        raise RuntimeError(f"the norm of a gradient sharded over the ranks (shard='gradients' or 'parameters') is "
                           f"taken over all its elements only (torch.linalg.vector_norm(g, ord)), got args {args[1:]} {kwargs}")
    if value is None or value == "fro":
        return 2.0
    if not isinstance(value, (int, float)) or not (value > 0 or value == -math.inf):
        raise RuntimeError(f"a norm of order {value} over gradients sharded across the ranks (shard='gradients' or "
                           f"'parameters') is not their norm in one process; autodist gives norms of order > 0, inf and -inf")
    return float(value)


def _norm(g: Any, ord: float) -> Any:
    if isinstance(g, ShardedGrad):
        local = g.local
        if local.numel() == 0 and math.isinf(ord):  # no identity in torch: a norm is >= 0, so 0 for max
            value = torch.tensor(0.0 if ord > 0 else math.inf, dtype=local.dtype, device=local.device)
        else:
            value = torch.linalg.vector_norm(local, ord)
        part = PartialNorm(value, ord, g.group, g.split, g.counted, g.inside)
        if not math.isinf(ord):  # the slice's sum of p-th powers, at float32 or wider: summed over the ranks
            part.power = local.to(torch.promote_types(local.dtype, torch.float32)).abs().pow(ord).sum()
        return part
    return torch.linalg.vector_norm(g, ord)


def _local(t: Any) -> Any:
    return t.local if isinstance(t, ShardedGrad) else t


def _each(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` applied to the slice of a ShardedGrad (in place), to a plain tensor as it is."""
    def apply(t: Any, *args: Any, **kwargs: Any) -> Any:
        op(_local(t), *args, **kwargs)
        return t
    return apply


def _foreach(op: Callable[..., Any]) -> Callable[..., Any]:
    def apply(tensors: list, *args: Any, **kwargs: Any) -> None:
        op([_local(t) for t in tensors], *args, **kwargs)
    return apply


def _unscale(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale of the slices, and its inf/NaN flag made the whole gradients' (a max over the ranks
    that hold slices of them: one all-reduce, which every rank takes as each unscales), so that every rank skips
    the step one process would skip."""
    torch._amp_foreach_non_finite_check_and_unscale_([_local(g) for g in grads], found_inf, inv_scale)
    sharded = next(g for g in grads if isinstance(g, ShardedGrad))
    for group in [sharded.group, *(sharded.split or ())]:
        torch.distributed.all_reduce(found_inf, torch.distributed.ReduceOp.MAX, group=group)


_ELEMENTWISE: dict[Any, Callable[..., Any]] = {
    torch.Tensor.mul_: _each(torch.Tensor.mul_), torch.Tensor.div_: _each(torch.Tensor.div_),
    torch.Tensor.zero_: _each(torch.Tensor.zero_), torch.Tensor.clamp_: _each(torch.Tensor.clamp_),
    torch._foreach_mul_: _foreach(torch._foreach_mul_), torch._foreach_zero_: _foreach(torch._foreach_zero_),
    torch._foreach_clamp_min_: _foreach(torch._foreach_clamp_min_),
    torch._foreach_clamp_max_: _foreach(torch._foreach_clamp_max_),
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale,
}


class PartialNorm(torch.Tensor):
    """One rank's part of a norm over gradients sharded across the data-parallel ranks: ``local`` holds the
    norm of its slices. ``torch.linalg.vector_norm`` of a stack of them is the whole norm, the same on every
    rank (one all-reduce: every rank must take it, as ``clip_grad_norm_`` does)."""

    local: torch.Tensor
    ord: float
    group: Any  # the data-parallel group; once stacked, the group the parts are summed over
    split: tuple[Any] | None  # (the model-parallel group,) for the norm of an MP layer's shard
    here: list[bool]  # once stacked: which parts this rank counts (a part other ranks hold alike counts once)
    power: torch.Tensor | None  # the slice's sum of |x|**ord (finite orders), for the whole gradient's norm

    @staticmethod
    def __new__(cls, local: torch.Tensor, ord: float, group: Any, split: tuple[Any] | None = None,
                counted: bool = True, inside: tuple[Any] | None = None) -> "PartialNorm":
        t = torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype, device=local.device)
        t.local, t.ord, t.group, t.split, t.here, t.counted = local, ord, group, split, [], counted
        t.inside = inside  # beside experts placed over the data-parallel ranks (ep): see _with_experts
        t.power = None  # the slice's sum of |x|**ord (finite orders), for the whole gradient's norm
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return "PartialNorm(this rank's part of the norm of gradients sharded over the ranks)"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _passes(func):
            return _plain(func, args, kwargs)
        if func is torch.Tensor.to and isinstance(args[0], PartialNorm):
            moved = PartialNorm(args[0].local.to(*args[1:], **kwargs), args[0].ord, args[0].group, args[0].split,
                                args[0].counted, args[0].inside)
            moved.power = args[0].power
            return moved
        if func is torch.stack and not kwargs.get("dim") and len(args) == 1:
            return _stack(args[0])
        if func is torch.linalg.vector_norm and isinstance(args[0], PartialNorm) and \
                float(_ord(args, kwargs)) == args[0].ord and args[0].local.dim() == 1:
            return _whole_norm(args[0])
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on the norm of a gradient sharded over the ranks "
            f"(parallelize(..., shard='gradients' or 'parameters')): each rank holds only its part of that norm. "
            f"torch.nn.utils.clip_grad_norm_ / get_total_norm over the model's parameters give the global norm on "
            f"every rank; use shard='optimizer' to keep whole gradients")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on this rank's part of a norm of sharded gradients: use "
                           f"torch.nn.utils.clip_grad_norm_ or get_total_norm for the global norm")


def _stack(norms: list[Any]) -> PartialNorm:
    partial = [n for n in norms if isinstance(n, PartialNorm)]
    first = partial[0]
    if any(n.ord != first.ord or n.group is not first.group for n in partial):
        raise RuntimeError("norms of sharded gradients of different orders or groups cannot be stacked")
    # A part other ranks hold alike counts on one of them: a whole gradient (every data-parallel rank holds it)
    # on the data-parallel group's first rank; under mp=K, a gradient every rank of the model-parallel group
    # holds (not an MP layer's shard) on that group's first rank, and the parts are summed over the world.
    if any(getattr(n, "inside", None) is not None for n in norms):
        return _with_experts(norms, partial)
    splits = [n.split for n in partial if n.split is not None] + [(n.group,) for n in norms
                                                                  if isinstance(n, SplitNorm)]
    if not splits and all(n.power is not None for n in partial):
        return _each_whole(norms, partial)
    first_mp = first_rank(splits[0][0]) if splits else True
    first_dp = first_rank(first.group)
    here = [(n.counted if n.split is not None else first_mp) if isinstance(n, PartialNorm) else
            first_dp and (n.counted if isinstance(n, SplitNorm) else first_mp) for n in norms]
    parts = [(n.local if isinstance(n, PartialNorm) else n.detach()).to(first.local.device) for n in norms]
    stacked = PartialNorm(torch.stack(parts), first.ord, None if splits else first.group)
    stacked.here = here
    return stacked


def _with_experts(norms: list[Any], partial: list[PartialNorm]) -> PartialNorm:
    """The stack with experts placed over the data-parallel ranks (ep): their norms split over an expert group
    inside the data-parallel group, each expert group a replica of the others. Summed over the data-parallel
    group: each rank's slices of the sharded gradients, the experts of the first replica group, and a whole
    gradient every rank holds alike on the group's first rank. Under mp=K too, summed over the world: a
    model-parallel shard's slices on every rank, what every rank of a model-parallel group holds alike (the
    other slices, the experts, whole gradients) on that group's first rank; under pp, each stage's slices and
    experts (the experts' marks say where they count). Every rank takes this path (the
    sharded gradients carry ``inside`` too), also one whose experts got no gradient this step."""
    first = partial[0]
    experts = [n for n in norms if isinstance(n, SplitNorm)]
    if any(n.inside is None for n in experts):
        raise RuntimeError("the norm of gradients split over the ranks by a layer other than ep's experts, beside "
                           "them, under shard='gradients', is not built: use shard='optimizer'")
    replicas = next(n.inside for n in norms if getattr(n, "inside", None) is not None)[0]
    counted = replicas is None or first_rank(replicas)
    mp = next((n.split[0] for n in partial if n.split is not None), False)
    first_mp = mp is False or first_rank(mp)
    first_dp = first_rank(first.group)
    here = [(n.counted if n.split is not None else first_mp) if isinstance(n, PartialNorm) else
            counted and bool(n.inside[1]) if isinstance(n, SplitNorm) else first_dp and first_mp for n in norms]
    parts = [(n.local if isinstance(n, PartialNorm) else n.detach()).to(first.local.device) for n in norms]
    stacked = PartialNorm(torch.stack(parts), first.ord, first.group if mp is False else None)
    stacked.here = here
    return stacked


def _each_whole(norms: list[Any], partial: list[PartialNorm]) -> torch.Tensor:
    """The stack one process takes: each gradient's whole norm, in its dtype. The slices' sums of p-th powers
    are summed over the ranks (one all-reduce, at float32 or wider) and each gradient's norm is rounded to its
    dtype from its sum, as torch rounds a norm it takes of a whole gradient: a bfloat16 gradient's norm is one
    process's bit for bit (but where the float32 sums, added in another order, straddle a bfloat16 rounding
    boundary), a float32 one's within float32's rounding. The norm of the stack is then torch's own."""
    wide = partial[0].power.dtype
    for n in partial[1:]:
        wide = torch.promote_types(wide, n.power.dtype)
    sums = torch.stack([n.power.to(wide) for n in partial])
    torch.distributed.all_reduce(sums, group=partial[0].group)
    whole = iter(sums.pow(1.0 / partial[0].ord) if partial[0].ord != 1.0 else sums)
    device = partial[0].local.device
    return torch.stack([(next(whole).to(n.local.dtype) if isinstance(n, PartialNorm) else n.detach()).to(device)
                        for n in norms])


def _whole_norm(stacked: PartialNorm) -> torch.Tensor:
    """The norm over every rank's parts: the sum of their p-th powers (max, min for +-inf), all-reduced."""
    return whole_norm(stacked.local, stacked.here, stacked.ord, stacked.group)
