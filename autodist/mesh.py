"""How the ranks are laid out: ``world = dp x mp``, model-parallel groups of consecutive ranks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """A validated ``dp x mp`` layout of ``world_size`` ranks.

    Ranks of one model-parallel group are consecutive (``rank // mp`` is the
    data-parallel rank) so that they share a node and its fast links.

    Example:
        >>> dims = ParallelDims.for_world(world_size=4, mp=2)
        >>> dims.dp, dims.dp_rank(3), dims.mp_rank(3)
        (2, 1, 1)
    """

    dp: int
    mp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.dp < 1 or self.mp < 1:
            raise ValueError(f"dp ({self.dp}) and mp ({self.mp}) must be at least 1")
        if self.dp * self.mp != self.world_size:
            raise ValueError(f"dp({self.dp}) * mp({self.mp}) != world_size({self.world_size})")

    @classmethod
    def for_world(cls, world_size: int, mp: int = 1) -> "ParallelDims":
        if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
            raise ValueError(f"mp must be a positive int, got {mp!r}")
        if world_size % mp:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"mp={mp} does not divide the {world_size} ranks; choose mp from {divisors}")
        return cls(dp=world_size // mp, mp=mp, world_size=world_size)

    def dp_rank(self, rank: int) -> int:
        return rank // self.mp

    def mp_rank(self, rank: int) -> int:
        return rank % self.mp
