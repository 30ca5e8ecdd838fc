"""How the ranks are laid out: ``world = dp x pp x mp``, model-parallel groups of consecutive ranks, then the
pipeline's stages, then the data-parallel replicas; with context parallelism (``cp``), each ``cp`` consecutive
data-parallel ranks share their sequences (:func:`context_ranks`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """A validated ``dp x pp x mp`` layout of ``world_size`` ranks.

    Ranks of one model-parallel group are consecutive so that they share a node and its fast links; the
    ``pp`` stages of one pipeline come next (rank ``(d * pp + s) * mp + m`` is model-parallel rank ``m`` of
    stage ``s`` of data-parallel replica ``d``).

    Example:
        >>> dims = ParallelDims.for_world(world_size=4, mp=2)
        >>> dims.dp, dims.dp_rank(3), dims.mp_rank(3)
        (2, 1, 1)
        >>> ParallelDims.for_world(world_size=8, mp=2, pp=2).stage(6)
        1
    """

    dp: int
    mp: int
    world_size: int
    pp: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.mp < 1 or self.pp < 1:
            raise ValueError(f"dp ({self.dp}), pp ({self.pp}) and mp ({self.mp}) must be at least 1")
        if self.dp * self.pp * self.mp != self.world_size:
            raise ValueError(f"dp({self.dp}) * pp({self.pp}) * mp({self.mp}) != world_size({self.world_size})")

    @classmethod
    def for_world(cls, world_size: int, mp: int = 1, pp: int = 1) -> "ParallelDims":
        for name, value in (("mp", mp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if world_size % (mp * pp):
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            what = f"mp={mp}" if pp == 1 else f"mp x pp = {mp} x {pp}" if mp > 1 else f"pp={pp}"
            raise ValueError(f"{what} does not divide the {world_size} ranks; choose "
                             f"{'mp' if pp == 1 else 'pp' if mp == 1 else 'mp x pp'} from {divisors}")
        return cls(dp=world_size // (mp * pp), mp=mp, world_size=world_size, pp=pp)

    def dp_rank(self, rank: int) -> int:
        return rank // (self.mp * self.pp)

    def mp_rank(self, rank: int) -> int:
        return rank % self.mp

    def stage(self, rank: int) -> int:
        """The pipeline stage ``rank`` runs (0 without pipeline parallelism)."""
        return rank // self.mp % self.pp

    def rank_of(self, dp_rank: int, stage: int, mp_rank: int) -> int:
        return (dp_rank * self.pp + stage) * self.mp + mp_rank

    def mp_ranks(self, rank: int) -> list[int]:
        """The model-parallel group of ``rank``: consecutive ranks."""
        return [self.rank_of(self.dp_rank(rank), self.stage(rank), m) for m in range(self.mp)]

    def dp_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same part of the model as ``rank``, in data-parallel order."""
        return [self.rank_of(d, self.stage(rank), self.mp_rank(rank)) for d in range(self.dp)]

    def pp_ranks(self, rank: int) -> list[int]:
        """The stages of ``rank``'s pipeline, in stage order."""
        return [self.rank_of(self.dp_rank(rank), s, self.mp_rank(rank)) for s in range(self.pp)]

    def replica_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s data-parallel replica: every stage and every model-parallel rank of it."""
        return [self.rank_of(self.dp_rank(rank), s, m) for s in range(self.pp) for m in range(self.mp)]

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind ("dp", "mp", "pp" or "replica"), in the order every rank creates them."""
        if kind == "replica":
            return [self.replica_ranks(self.rank_of(d, 0, 0)) for d in range(self.dp)]
        if kind == "mp":
            return [self.mp_ranks(self.rank_of(d, s, 0)) for d in range(self.dp) for s in range(self.pp)]
        if kind == "dp":
            return [self.dp_ranks(self.rank_of(0, s, m)) for s in range(self.pp) for m in range(self.mp)]
        return [self.pp_ranks(self.rank_of(d, 0, m)) for d in range(self.dp) for m in range(self.mp)]


@dataclass(frozen=True)
class Groups:
    """This rank's process groups; None stands for the whole world (torch's default group).

    With dp == 1 there is nothing to average (the caller installs no gradient
    sync); with mp == 1 there is no model-parallel group; with pp == 1 no pipeline.
    """

    dp: object | None
    mp: object | None
    pp: object | None = None


_groups_cache: dict[ParallelDims, Groups] = {}


def built_groups(dims: ParallelDims) -> Groups | None:
    """The groups :func:`build_groups` made for ``dims`` in this process, or None if it made none yet."""
    return _groups_cache.get(dims)


def _made(dims: ParallelDims, kind: str, rank: int) -> object:
    """``rank``'s group of one kind, made with every other group of that kind (in the same order on every rank,
    as new_group requires)."""
    return _made_of(dims.all_groups(kind), rank)


def _made_of(every: list[list[int]], rank: int) -> object:
    """``rank``'s group of ``every`` (groups of ranks), each made in that order on every rank."""
    from autodist.runtime.world import new_group

    mine = None
    for ranks in every:
        g = new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def _mine(dims: ParallelDims, kind: str, rank: int) -> object | None:
    """:func:`_made`, or None where one group is the whole world or groups of one rank are never used."""
    every = dims.all_groups(kind)
    return None if len(every) == 1 or len(every[0]) == 1 else _made(dims, kind, rank)


def build_groups(dims: ParallelDims, rank: int) -> Groups:
    """The data-parallel, model-parallel and pipeline groups holding ``rank``; every rank must call this together.

    torch.distributed.new_group is collective over the whole world, so every
    rank creates every group, in the same order; the groups are made once per
    layout and reused.
    """
    if dims in _groups_cache:
        return _groups_cache[dims]
    groups = Groups(dp=_mine(dims, "dp", rank), mp=_mine(dims, "mp", rank), pp=_mine(dims, "pp", rank))
    _groups_cache[dims] = groups
    return groups


def replica_group(dims: ParallelDims, rank: int) -> object | None:
    """A process group over ``rank``'s data-parallel replica (None: the whole world), where a norm over a model
    both cut into stages and split by mp is summed. Collective over the world; made once per layout."""
    key = (dims, "replica")
    if key not in _second_cache:
        _second_cache[key] = _mine(dims, "replica", rank)
    return _second_cache[key]


def second_dp_group(dims: ParallelDims, rank: int, purpose: str = "gathers") -> object:
    """A process group of its own over ``rank``'s data-parallel ranks, for collectives that must never be
    ordered against the ones on the data-parallel group (``shard="parameters"`` gathers its blocks on it
    while the gradient sync reduce-scatters on the other); one per ``purpose`` ("reads": the gathers of
    ``state_dict``, ``full_parameters`` and copies, which a rank may enter alone by mistake: it then waits
    there, named, instead of meeting another rank's forward; for the layout with ``mp=1`` that is a group
    over the whole world). Collective over the world; made once per layout and purpose."""
    key = (dims, purpose)
    if key not in _second_cache:
        _second_cache[key] = _made(dims, "dp", rank)
    return _second_cache[key]


_second_cache: dict[tuple[ParallelDims, str], object] = {}


def context_ranks(dims: ParallelDims, cp: int, rank: int) -> list[int]:
    """The ranks sharing ``rank``'s sequences under context parallelism: ``cp`` consecutive ones of its
    data-parallel ranks (``dims.dp`` counting data-parallel x ``cp``: the gradient sync runs over them all). With
    ``mp``, each model-parallel rank of a context-parallel rank holds the same tokens (its slice of the heads).

    Example:
        >>> context_ranks(ParallelDims.for_world(8, mp=2), cp=2, rank=5)   # dp 2 x cp 2 x mp 2
        [5, 7]
    """
    first = dims.dp_rank(rank) // cp * cp
    return dims.dp_ranks(rank)[first:first + cp]


def expert_groups(dims: ParallelDims, ep: int, rank: int) -> tuple[object | None, object | None]:
    """Expert parallelism's groups for ``rank``: the ``ep`` consecutive data-parallel ranks its experts are placed
    over (None: the whole world), and the ranks holding the same experts in the other such groups (None: there are
    none, ``dp == ep``). Collective over the world; made once per layout."""
    key = (dims, f"ep={ep}")
    if key not in _second_cache:
        places = _runs(dims, ep)
        copies = [ranks[i::ep] for ranks in dims.all_groups("dp") for i in range(ep)]
        _second_cache[key] = (_made_of(places, rank) if len(places) > 1 else None,
                              _made_of(copies, rank) if dims.dp > ep else None)
    return _second_cache[key]  # type: ignore[return-value]


def context_group(dims: ParallelDims, cp: int, rank: int) -> object | None:
    """A process group over :func:`context_ranks` (None: the whole world). Collective over the world; made once
    per layout."""
    key = (dims, f"cp={cp}")
    if key not in _second_cache:
        every = _runs(dims, cp)
        _second_cache[key] = _made_of(every, rank) if len(every) > 1 else None
    return _second_cache[key]


def _runs(dims: ParallelDims, k: int) -> list[list[int]]:
    """Every data-parallel group cut into runs of ``k`` consecutive ranks (cp's sequence groups, ep's expert
    groups)."""
    return [ranks[i:i + k] for ranks in dims.all_groups("dp") for i in range(0, dims.dp, k)]
