"""How the parameters are cut between the servers: one flat vector, split into equal contiguous ranges."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` a shard holds: its elements ``[start, stop)`` at ``offset`` in the shard."""

    param: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class ShardLayout:
    """The model's parameters laid end to end (in ``model.parameters()`` order) and cut by size: server ``i``
    (world rank ``servers[i]``) holds elements ``bounds[i]`` of that flat vector, so every server holds the
    same number of elements (to one), whatever the sizes of the tensors.

    Example:
        >>> layout = ShardLayout.split((6, 2), servers=(0, 1))
        >>> layout.bounds
        ((0, 4), (4, 8))
        >>> layout.pieces(1)
        [Piece(param=0, start=4, stop=6, offset=0), Piece(param=1, start=0, stop=2, offset=2)]
    """

    sizes: tuple[int, ...]
    servers: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]

    @staticmethod
    def split(sizes: tuple[int, ...], servers: tuple[int, ...]) -> "ShardLayout":
        total, k = sum(sizes), len(servers)
        if total < k:
            raise ValueError(f"the model has {total} parameter elements, fewer than the {k} servers asked for; "
                             f"use servers={max(1, total)} or fewer")
        bounds = tuple((total * i // k, total * (i + 1) // k) for i in range(k))
        return ShardLayout(tuple(sizes), tuple(servers), bounds)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def pieces(self, server: int) -> list[Piece]:
        """The parts of parameters server ``server`` (an index into ``servers``) holds, in flat order."""
        lo, hi = self.bounds[server]
        out, begin = [], 0
        for i, n in enumerate(self.sizes):
            a, b = max(lo, begin), min(hi, begin + n)
            if a < b:
                out.append(Piece(i, a - begin, b - begin, a - lo))
            begin += n
        return out


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float CPU vector of ``tensors`` end to end (a copy)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (each keeps its dtype and device)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
