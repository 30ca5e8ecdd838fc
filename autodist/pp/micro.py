"""A forward's arguments cut into micro-batches, and the micro-batches' outputs put back together.

Every tensor of the arguments (through tuples, lists, dicts and whatever ``torch.utils._pytree`` knows) whose
dimension ``batch_dim`` has the batch's size is cut along it; other values go whole to every micro-batch.
Outputs come back the other way: a tensor with the micro-batch's rows is concatenated (along ``batch_dim``, or
the one dimension that holds them), a number (a loss the model computes itself, a mean over its micro-batch)
becomes the mean weighted by each micro-batch's count, so that a mean over the batch is the one the whole batch
gives: its samples, or for a mean over valid tokens (a language model's own loss with labels at -100) the
tokens read from its graph. A gradient arriving at the merged output is cut the same way
(:meth:`Merged.cut_grad`).

Example:
    >>> parts = cut((x,), {}, pieces=4, dim=0)        # 4 (args, kwargs), the rows of x split
    >>> merged = merge([model(*a, **k) for a, k in parts.calls], parts.counts, dim=0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from autodist.dp.loss_reading import read
from autodist.runtime.tree import tensor_leaves


@dataclass
class Parts:
    calls: list[tuple[tuple, dict]]  # each micro-batch's (args, kwargs)
    rows: list[int]  # each micro-batch's rows
    targets: list[Any] | None = None  # each micro-batch's part of the loss's target (``loss_fn``)


def _batch_size(flat: list[Any], dim: int, args: tuple, kwargs: dict) -> int:
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            return leaf.shape[dim]
    raise ValueError(f"pp cuts each batch into micro-batches along dimension {dim} of the forward's tensors, and "
                     f"this forward has none ({len(args)} positional and {len(kwargs)} keyword arguments): pass the "
                     f"batch as tensors, or batch_dim= where the samples are indexed")


def _cut_target(target: Any, rows: list[int], dim: int) -> list[Any]:
    """The loss's target cut like the inputs: each tensor along ``dim``, or along its one dimension of the batch's
    size ((seq, batch) inputs, (batch,) labels); anything else is an error, never handed whole to every piece."""
    n = sum(rows)
    flat, spec = pytree.tree_flatten(target)
    split = []
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            split.append([leaf] * len(rows))
            continue
        dims = [d for d in range(leaf.dim()) if leaf.shape[d] == n]
        along = dim if dim in dims else dims[0] if len(dims) == 1 else None
        if along is None:
            raise ValueError(f"target= holds a tensor of shape {tuple(leaf.shape)} that pp cannot cut into the "
                             f"micro-batches' parts: none or several of its dimensions have the batch's {n} rows")
        split.append(list(leaf.split(rows, along)))
    return [pytree.tree_unflatten([parts[i] for parts in split], spec) for i in range(len(rows))]


def pieces_for(args: tuple, kwargs: dict, pieces: int, dim: int) -> int:
    """How many micro-batches :func:`cut` makes of this batch: ``pieces``, fewer for a batch with fewer rows."""
    flat, _ = pytree.tree_flatten((args, kwargs))
    return _fewer(pieces, _batch_size(flat, dim, args, kwargs))


def _fewer(pieces: int, rows: int) -> int:
    return max(1, min(pieces, rows))


def cut(args: tuple, kwargs: dict, pieces: int, dim: int, target: Any = None) -> Parts:
    """``args, kwargs`` cut into at most ``pieces`` micro-batches along ``dim`` (fewer for a batch with fewer rows;
    the first ones one row larger where they do not divide); ``target`` (the loss's) cut alike."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    n = _batch_size(flat, dim, args, kwargs)
    pieces = _fewer(pieces, n)
    rows = [n // pieces + (1 if i < n % pieces else 0) for i in range(pieces)]
    split = [list(leaf.split(rows, dim)) if isinstance(leaf, torch.Tensor) and leaf.dim() > dim
             and leaf.shape[dim] == n else None for leaf in flat]
    for leaf, parts in zip(flat, split):
        if parts is None and not isinstance(leaf, torch.Tensor):
            inside = next((path for path, t in tensor_leaves(leaf) if t.dim() > dim and t.shape[dim] == n), None)
            if inside is not None:
                raise TypeError(f"pp cuts each batch into micro-batches, and a {type(leaf).__name__} in the "
                                f"forward's arguments holds batch rows ({inside}) that autodist cannot cut: pass "
                                f"tensors, tuples, lists or dicts of them, or register the class with "
                                f"torch.utils._pytree")
    calls = []
    for i in range(pieces):
        a, k = pytree.tree_unflatten([leaf if parts is None else parts[i] for leaf, parts in zip(flat, split)], spec)
        calls.append((a, k))
    return Parts(calls, rows, None if target is None else _cut_target(target, rows, dim))


@dataclass
class Merged:
    """The merged output and how each of its tensors was made from the micro-batches'."""

    value: Any
    how: list[tuple[str, Any]]  # per leaf of ``value``: ("cat", dim) | ("mean", weights) | ("first" | "value", None)
    count: float | None = None  # a loss leaf that is a mean over valid tokens: the batch's tokens (its weight)

    def cut_grad(self, index: int, grad: torch.Tensor | None, rows: list[int]) -> list[torch.Tensor | None]:
        """The gradient of leaf ``index`` of the merged output, cut into the micro-batches' parts."""
        if grad is None:
            return [None] * len(rows)
        kind, arg = self.how[index]
        if kind == "cat":
            return list(grad.split(rows, arg))
        if kind == "mean":
            return [grad * w for w in arg]
        return [grad] + [None] * (len(rows) - 1)  # taken from the first micro-batch alone


def _rows_dim(leaves: tuple, rows: list[int], dim: int) -> int | None:
    """The dimension along which the micro-batches' tensors hold their rows: ``dim`` where it does, else the one
    dimension that does (an output batched along another dimension than the input: (seq, batch) in, (batch,
    classes) out); None where none does, or several could."""
    first = leaves[0]
    shapes = [t.shape for t in leaves]
    fits = [d for d in range(first.dim()) if [s[d] for s in shapes] == rows
            and all(s[:d] == first.shape[:d] and s[d + 1:] == first.shape[d + 1:] for s in shapes)]
    if dim in fits:
        return dim
    return fits[0] if len(fits) == 1 else None


def _loss_counts(leaves: tuple) -> list[float] | None:
    """A loss the model computes itself that is a mean over what the data does not count (valid tokens, read
    from its graph: :mod:`autodist.dp.loss_reading`): each micro-batch's count, which weights it, so that the
    merged loss is the whole batch's mean over tokens. None where the micro-batches' losses are not such means."""
    counts = [read([t]).count if t.requires_grad else None for t in leaves]
    return None if any(c is None for c in counts) else counts  # type: ignore[return-value]


def merge(outputs: list[Any], rows: list[int], counts: list[float], dim: int,
          dropped: Callable[[str, Any], None]) -> Merged:
    """The micro-batches' outputs as the whole batch's: see the module docstring. ``dropped(path, value)`` is
    told of a value that differs between micro-batches and cannot be merged (it becomes None)."""
    flats = [pytree.tree_flatten(out) for out in outputs]
    spec = flats[0][1]
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(outputs[0])[0]]
    if any(s != spec for _, s in flats):
        raise ValueError("the model's forward returned differently structured outputs for the micro-batches of one "
                         "batch; pp needs one structure per batch")
    total = sum(counts)
    weights = [c / total if total else 0.0 for c in counts]
    merged, how = [], []
    count = None
    for i, leaves in enumerate(zip(*(flat for flat, _ in flats))):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            along = _rows_dim(leaves, rows, dim)
            if along is not None:
                merged.append(torch.cat([t.detach() for t in leaves], along))
                how.append(("cat", along))
            elif first.dim() == 0 and first.is_floating_point():
                read_counts = _loss_counts(leaves)
                shares = weights
                if read_counts is not None:
                    count = sum(read_counts) if count is None else count
                    shares = [c / sum(read_counts) if sum(read_counts) else 0.0 for c in read_counts]
                merged.append(sum(t.detach() * w for t, w in zip(leaves, shares)))
                how.append(("mean", shares))
            elif len(leaves) == 1:
                merged.append(first.detach())
                how.append(("first", None))
            else:
                raise ValueError(f"output{paths[i]} of the model's forward is a tensor of shape {tuple(first.shape)}, "
                                 f"neither per-sample rows (dimension {dim} of the micro-batch's size) nor one "
                                 f"number, so pp cannot put the micro-batches' values together: return per-sample "
                                 f"tensors or a mean, or use pp=1")
        elif isinstance(first, (type(None), bool, int, float, str)) and all(leaf == first for leaf in leaves[1:]):
            merged.append(first)
            how.append(("value", None))
        else:  # a value that differs between micro-batches, or one no other stage could be sent (a cache)
            dropped(f"output{paths[i]}", first)
            merged.append(None)
            how.append(("value", None))
    return Merged(pytree.tree_unflatten(merged, spec), how, count)
