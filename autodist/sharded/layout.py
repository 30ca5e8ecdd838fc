"""Which elements of which parameters each data-parallel rank owns: an even cut of the flat parameter vector.

The trainable parameters of one dtype and device, flattened in the model's order, form one vector of T
elements; rank r owns elements ``[r*c, min((r+1)*c, T))`` with ``c = ceil(T / N)``. A parameter may be
cut between two ranks: each owns a *piece* ``(parameter, start, stop)`` of its flattened elements. So each
rank holds 1/N of the elements (to within one element), whatever the parameters' sizes.

Example:
    >>> layout = Layout.of([torch.zeros(3, 2), torch.zeros(4)], ranks=2)
    >>> [(p.index, p.start, p.stop) for p in layout.kinds[0].pieces[1]]
    [(0, 5, 6), (1, 0, 4)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of parameter ``index`` (in the layout's parameter list), flattened; ``at``: where
    they sit in their owner's chunk."""

    index: int
    start: int
    stop: int
    at: int

    def in_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """Where the piece's elements sit in ``chunk`` (its owner's)."""
        return chunk[self.at:self.at + self.stop - self.start]


@dataclass
class Kind:
    """The parameters of one dtype and device: their flat vector cut into ``ranks`` chunks of ``chunk``."""

    dtype: torch.dtype
    device: torch.device
    indices: list[int]
    total: int
    chunk: int
    pieces: list[list[Piece]] = field(default_factory=list)  # per rank


@dataclass
class Layout:
    """The cut of every trainable parameter over ``ranks`` data-parallel ranks."""

    ranks: int
    sizes: list[int]
    kinds: list[Kind]

    @staticmethod
    def of(params: list[torch.Tensor], ranks: int) -> "Layout":
        by_kind: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            by_kind.setdefault((p.dtype, p.device), []).append(i)
        return Layout.of_groups(params, list(by_kind.values()), ranks)

    @staticmethod
    def of_groups(params: list[torch.Tensor], groups: list[list[int]], ranks: int) -> "Layout":
        """Each group of parameter indices (one dtype and device, in the order given) a flat vector of its own,
        cut as above: the buckets of ``shard="gradients"``, whose parts the ranks keep.

        Example:
            >>> layout = Layout.of_groups([torch.zeros(3), torch.zeros(4)], [[1], [0]], ranks=2)
            >>> [(p.index, p.start, p.stop) for p in layout.mine(1)]
            [(1, 2, 4), (0, 2, 3)]
        """
        kinds = []
        for indices in groups:
            dtype, device = params[indices[0]].dtype, params[indices[0]].device
            total = sum(params[i].numel() for i in indices)
            chunk = max(1, math.ceil(total / ranks))
            kind = Kind(dtype, device, indices, total, chunk, [[] for _ in range(ranks)])
            offset = 0
            for i in indices:
                n = params[i].numel()
                for r in range(offset // chunk, ranks):
                    lo, hi = max(offset, r * chunk), min(offset + n, (r + 1) * chunk)
                    if lo >= hi:
                        break
                    kind.pieces[r].append(Piece(i, lo - offset, hi - offset, lo - r * chunk))
                offset += n
            kinds.append(kind)
        return Layout(ranks, [p.numel() for p in params], kinds)

    def mine(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` owns, in every kind."""
        return [piece for kind in self.kinds for piece in kind.pieces[rank]]
