"""How many samples a forward pass saw: the share of the global batch behind a backward's weight.

For a loss that is a mean over the batch, rank r's gradient enters the global
one with weight n_r / N. Each forward pass of a parallelized model is counted
here, first match wins:

1. ``parallelize(..., samples=fn)``: ``fn(*args, **kwargs)`` counts (tokens,
   say, for a per-token mean); N is the sum over the ranks.
2. A tensor in the forward's arguments that a sharded DataLoader yielded, or a
   view of one: that batch's n_r and N, known without looking at its layout.
3. A view of a tensor sharded by ``parallelize``: the rows of the shard it covers.
4. The batch the sharded DataLoader handed to this thread last (inputs copied
   to a GPU are new tensors): its n_r and N, provided some input has a
   dimension of n_r; if none has, a warning says the batch may be another one.
5. Inference for data autodist did not shard: the size of dimension
   ``batch_dim`` of the tensors in the arguments (dataclasses, mappings, named
   tuples and lists are walked); tensors that disagree, or no tensor at all,
   make the count unknown, and a backward through that forward raises on
   every rank, naming the arguments and the fix.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autodist.runtime import provenance
from autodist.runtime.tree import arguments, tensor_leaves
from autodist.runtime.world import log

SampleFn = Callable[..., int]

_FIX = ("tell autodist how to count: parallelize(model, data, batch_dim=D) if dimension D of the inputs indexes "
        "the samples (batch_dim=1 for (seq, batch) inputs), or parallelize(model, data, samples=fn) with fn called "
        "like the model's forward, returning this rank's sample count; or pass the DataLoader to parallelize, "
        "which knows each batch's count")


@dataclass(frozen=True)
class Counted:
    """What one forward pass brings to the weight of a backward through it.

    Example:
        >>> Counted(count=3, total=8).weight
        0.375
    """

    count: float  # n_r: samples (or whatever samples= counts); NaN when this rank cannot count
    total: int | None = None  # N when the data pipeline knows it; None: summed over the ranks at sync
    batch: int | None = None  # the global batch it came from: two forwards on one batch count once
    error: str | None = None  # why the count is unknown
    mark: int | None = None  # the identity of its global batch(es) where a sharded DataLoader handed them out
    guess: float | None = None  # total None: the N to pack with until the sum says (the loader's, for a count
    # read from the loss: where the loss is a mean over the samples after all, nothing is corrected)

    @property
    def weight(self) -> float:
        return self.count / self.total if self.total else 0.0

    @property
    def stand_in(self) -> bool:
        """A forward on the row a rank got for a global batch it holds none of: its gradient is zero."""
        return self.count == 0 and bool(self.total)


def combine(parts: list[Counted]) -> Counted:
    """One backward through several forwards: distinct batches add up."""
    seen: dict[Any, Counted] = {}
    for part in parts:
        seen.setdefault(part.batch if part.batch is not None else ("forward", id(part)), part)
    unique = list(seen.values())
    if len(unique) == 1:
        return unique[0]
    errors = [p.error for p in unique if p.error]
    totals, guesses = [p.total for p in unique], [p.guess for p in unique]
    return Counted(sum(p.count for p in unique), None if None in totals else sum(totals),  # type: ignore[arg-type]
                   None, errors[0] if errors else None, add_marks(p.mark for p in unique),
                   None if None in guesses else sum(guesses))  # type: ignore[arg-type]


def add_marks(marks: Any) -> int | None:
    """The identity of several global batches together (in any order); None if one of them has none."""
    total = 0
    for mark in marks:
        if mark is None:
            return None
        total = (total + mark) & 0xFFFFFFFF
    return total


def _describe(args: tuple, kwargs: dict, limit: int = 6) -> str:
    parts = [f"{path}: {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else f"{path}: {type(leaf).__name__}"
             for path, leaf in arguments(args, kwargs)]
    more = f", ... ({len(parts) - limit} more)" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more if parts else "no arguments"


def _unknown(why: str) -> Counted:
    return Counted(math.nan, error=f"autodist cannot count the samples of this forward pass: {why}; {_FIX}")


class SampleCounter:
    """Counts the samples of each forward pass of one parallelized model (see the module docstring)."""

    def __init__(self, batch_dim: int = 0, samples: SampleFn | None = None, tokens: SampleFn | None = None) -> None:
        """``tokens``: context parallelism's count of a forward's tokens, in place of the data's rows (a loss
        read still says what it divides by, where ``samples`` overrides even that)."""
        self.batch_dim, self.samples, self.tokens = batch_dim, samples, tokens
        self.warned = False

    def __call__(self, args: tuple, kwargs: dict) -> Counted:
        if self.samples is not None:
            return self._explicit(self.samples, "samples=fn", args, kwargs)
        if self.tokens is not None:
            return self._explicit(self.tokens, "the count of this rank's tokens", args, kwargs)
        known = self._known(args, kwargs)
        if known is not None:
            return known
        share = provenance.current()
        if share is not None:
            self._check_plausible(share, args, kwargs)
            return self.of_share(share)
        return self._infer(args, kwargs)

    def of_share(self, share: provenance.BatchShare) -> Counted:
        """The count of a backward weighted by the batch the sharded DataLoader handed out last (one that
        reached no counted output: a submodule called directly, a compiled forward)."""
        return Counted(share.count, share.total, share.batch, mark=share.mark)

    @staticmethod
    def _explicit(fn: SampleFn, what: str, args: tuple, kwargs: dict) -> Counted:
        try:
            count = fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported if a backward goes through this forward
            return _unknown(f"{what} raised {type(error).__name__}: {error}")
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = count.item()
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not count >= 0:
            return _unknown(f"{what} returned {count!r}, not a count (a non-negative int)")
        return Counted(float(count))

    def _known(self, args: tuple, kwargs: dict) -> Counted | None:
        rows: dict[str, int] = {}
        for path, leaf in arguments(args, kwargs):
            if not isinstance(leaf, torch.Tensor):
                continue
            found = provenance.known_share(leaf)
            if isinstance(found, provenance.BatchShare):
                return self.of_share(found)
            if found is not None:
                rows[path] = found
        if len(set(rows.values())) > 1:
            return _unknown(f"its inputs are slices of different numbers of rows of the sharded data ({rows})")
        return Counted(float(next(iter(rows.values())))) if rows else None

    def _check_plausible(self, share: provenance.BatchShare, args: tuple, kwargs: dict) -> None:
        shapes = [leaf.shape for _, leaf in arguments(args, kwargs) if isinstance(leaf, torch.Tensor)]
        if self.warned or share.count == 0 or not shapes or any(share.count in s for s in shapes):
            return
        self.warned = True
        log.warning("the forward's inputs (%s) have no dimension of %d, the size of this rank's part of the batch "
                    "the sharded DataLoader handed over last, whose share autodist uses as the weight of this step. "
                    "If the loop takes batches ahead of the step that uses them (its own prefetcher, a list of "
                    "batches), the weight belongs to another batch: iterate the loader directly or through "
                    "autodist.engine.prefetch, or pass parallelize(..., samples=fn)", _describe(args, kwargs),
                    share.count)

    def _infer(self, args: tuple, kwargs: dict) -> Counted:
        dim = self.batch_dim
        tensors = [(path, leaf) for path, leaf in arguments(args, kwargs) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return _unknown(f"its arguments hold no tensor ({_describe(args, kwargs)})")
        sizes = {path: t.shape[dim] for path, t in tensors if t.ndim > dim}
        if not sizes:
            return _unknown(f"no input tensor has a dimension {dim} (batch_dim={dim}; "
                            f"{_describe(args, kwargs)})")
        candidates = set(sizes.values())
        if len(candidates) > 1:
            candidates.discard(1)  # a size-1 dimension broadcasts over the batch
        if len(candidates) > 1:
            listed = ", ".join(f"{path} has {size}" for path, size in sizes.items())
            return _unknown(f"its input tensors disagree on the size of dimension {dim} (batch_dim={dim}): {listed}")
        return Counted(float(candidates.pop()))


def watch_outputs(output: Any, count: Callable[[], "Counted"], reached: Callable[["Counted", torch.Tensor], None]
                  ) -> None:
    """Call ``reached(counted, grad)`` whenever a backward reaches one of the forward's outputs needing a
    gradient; ``counted = count()`` is taken once, at the first such output (a forward with none costs nothing).

    Example:
        >>> watch_outputs(model(x), lambda: counter((x,), {}), on_reached)
    """
    counted = None
    for _, t in tensor_leaves(output):
        if t.requires_grad:
            counted = counted or count()
            t.register_hook(functools.partial(reached, counted))
