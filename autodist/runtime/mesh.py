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


@dataclass(frozen=True)
class Groups:
    """This rank's process groups; None stands for the whole world (torch's default group).

    With dp == 1 there is nothing to average (the caller installs no gradient
    sync); with mp == 1 there is no model-parallel group.
    """

    dp: object | None
    mp: object | None


_groups_cache: dict[ParallelDims, Groups] = {}


def built_groups(dims: ParallelDims) -> Groups | None:
    """The groups :func:`build_groups` made for ``dims`` in this process, or None if it made none yet."""
    return _groups_cache.get(dims)


def build_groups(dims: ParallelDims, rank: int) -> Groups:
    """The data-parallel and model-parallel groups holding ``rank``; every rank must call this together.

    torch.distributed.new_group is collective over the whole world, so every
    rank creates every group, in the same order; the groups are made once per
    layout and reused.
    """
    from autodist.runtime.world import new_group

    if dims in _groups_cache:
        return _groups_cache[dims]
    if dims.mp == 1 or dims.dp == 1:  # one of the two is the whole world
        groups = Groups(dp=None, mp=None)
    else:
        dp_group, mp_group = _new_dp_group(dims, rank), None
        for d in range(dims.dp):  # model-parallel groups: consecutive ranks
            g = new_group([d * dims.mp + m for m in range(dims.mp)])
            if dims.dp_rank(rank) == d:
                mp_group = g
        groups = Groups(dp=dp_group, mp=mp_group)
    _groups_cache[dims] = groups
    return groups


def _new_dp_group(dims: ParallelDims, rank: int) -> object:
    """Every data-parallel group (ranks with the same position in their MP group), made in the same order on
    every rank as new_group requires; ``rank``'s."""
    from autodist.runtime.world import new_group

    mine = None
    for m in range(dims.mp):
        g = new_group([d * dims.mp + m for d in range(dims.dp)])
        if dims.mp_rank(rank) == m:
            mine = g
    return mine


def second_dp_group(dims: ParallelDims, rank: int, purpose: str = "gathers") -> object:
    """A process group of its own over ``rank``'s data-parallel ranks, for collectives that must never be
    ordered against the ones on the data-parallel group (``shard="parameters"`` gathers its blocks on it
    while the gradient sync reduce-scatters on the other); one per ``purpose`` ("reads": the gathers of
    ``state_dict``, ``full_parameters`` and copies, which a rank may enter alone by mistake: it then waits
    there, named, instead of meeting another rank's forward; for the layout with ``mp=1`` that is a group
    over the whole world). Collective over the world; made once per layout and purpose."""
    key = (dims, purpose)
    if key not in _second_cache:
        _second_cache[key] = _new_dp_group(dims, rank)
    return _second_cache[key]


_second_cache: dict[tuple[ParallelDims, str], object] = {}

