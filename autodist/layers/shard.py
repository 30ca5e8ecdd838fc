"""How one parameter of a model-parallel layer is split: the single description every reader uses.

A ``Shard`` says which dimension of the dense tensor is split, in which
*blocks*, over which group, and which part this rank holds. A block is a run
of the split dimension that is split on its own: a plain Linear has one
block; a fused QKV projection has three (q, k, v), and each rank holds its
part of every block, so that its slice holds whole attention heads of q, k
and v. The layers take their shard with :meth:`Shard.take`;
``gather_state_dict``, checkpoints and ``explain`` read the same object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from autodist.layers.comm import all_gather_cat, shard_sizes
from autodist.layers.split_grad import mark_split


@dataclass(frozen=True)
class Shard:
    """This rank's part of one dense tensor.

    Attributes:
        shape: the dense tensor's shape.
        dim: the split dimension (None: every rank holds the whole tensor).
        blocks: for each block of ``dim``, in order, every rank's width of it.
        rank: this rank's index in the group.
        group: the process group the parts are spread over.

    Example:
        >>> s = Shard.even((12, 4), dim=0, blocks=(4, 4, 4), parts=2, rank=1)
        >>> s.take(torch.arange(48.).view(12, 4))[:, 0]     # rows 2-3, 6-7 and 10-11
        tensor([ 8., 12., 24., 28., 40., 44.])
    """

    shape: tuple[int, ...]
    dim: int | None = None
    blocks: tuple[tuple[int, ...], ...] = ()
    rank: int = 0
    group: Any = field(default=None, compare=False)

    @classmethod
    def even(cls, shape: Sequence[int], dim: int | None, blocks: Sequence[int] | None, parts: int, rank: int,
             group: Any = None) -> "Shard":
        """Each block (default: the whole dimension) split as evenly as possible, the first ranks one wider."""
        shape = tuple(shape)
        if dim is None:
            return cls(shape, None, (), rank, group)
        blocks = tuple(blocks) if blocks is not None else (shape[dim],)
        if sum(blocks) != shape[dim]:
            raise ValueError(f"blocks {blocks} do not add up to dimension {dim} of shape {shape}")
        return cls(shape, dim, tuple(tuple(shard_sizes(b, parts)) for b in blocks), rank, group)

    def __deepcopy__(self, memo: dict) -> "Shard":
        return self  # immutable, and a process group is live connections, not data to copy

    @property
    def parts(self) -> int:
        return len(self.blocks[0]) if self.blocks else 1

    def widths(self) -> list[int]:
        """Every rank's total width along ``dim``."""
        return [sum(block[r] for block in self.blocks) for r in range(self.parts)]

    def ranges(self, rank: int | None = None) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` runs of the dense dimension that ``rank`` (default: this one) holds, in order."""
        rank = self.rank if rank is None else rank
        runs, start = [], 0
        for block in self.blocks:
            lo = start + sum(block[:rank])
            runs.append((lo, lo + block[rank]))
            start += sum(block)
        return runs

    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[:self.dim] + (self.widths()[self.rank],) + self.shape[self.dim + 1:]

    def take(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``dense`` (a new contiguous tensor)."""
        if self.dim is None:
            return dense.detach().clone()
        parts = [dense.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges()]
        return torch.cat(parts, self.dim).contiguous() if len(parts) > 1 else parts[0].clone().contiguous()

    def parameter(self, dense: torch.Tensor) -> nn.Parameter:
        """This rank's part of ``dense`` as a parameter (trainable as ``dense`` is); a split one's gradient norm
        counts as a part of the model's norm over the group (:mod:`autodist.layers.split_grad`)."""
        p = nn.Parameter(self.take(dense.detach()), requires_grad=dense.requires_grad)
        if self.dim is not None and self.parts > 1:
            mark_split(p, self.group)
        return p

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The dense tensor from every rank's part. Collective: every rank of the group calls it."""
        if self.dim is None:
            return local.detach().clone()
        every = all_gather_cat(local.detach(), self.group, self.widths(), dim=self.dim)
        if len(self.blocks) == 1:
            return every
        pieces = every.split([block[r] for r in range(self.parts) for block in self.blocks], self.dim)
        n = len(self.blocks)
        return torch.cat([pieces[r * n + b] for b in range(n) for r in range(self.parts)], self.dim)

    def describe(self) -> str:
        if self.dim is None:
            return "whole"
        sizes = [sum(b) for b in self.blocks]
        return f"dim {self.dim}" + (f" in {len(sizes)} blocks of {sizes}" if len(sizes) > 1 else "")


class _TakeReplicated(torch.autograd.Function):
    """Forward: this rank's part of a tensor every rank holds whole; backward: the parts' gradients gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: Shard) -> torch.Tensor:  # type: ignore[override]
        ctx.shard = shard
        return shard.take(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.shard.gather(grad.contiguous()), None


def take_replicated(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's part of ``x``, a tensor every rank of ``shard.group`` holds whole (a per-head attention bias),
    differentiably: each rank's gradient covers only its part, so backward all-gathers the parts into the
    whole gradient, the same on every rank - only when ``x`` needs a gradient.

    Example:
        >>> bias_here = take_replicated(position_bias, Shard.even(position_bias.shape, 1, None, 2, rank, group))
    """
    if not x.requires_grad:
        return shard.take(x)
    return _TakeReplicated.apply(x, shard)
