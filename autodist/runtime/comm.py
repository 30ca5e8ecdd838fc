"""Collectives over named communicators: a thin, typed layer over ``torch.distributed``.

A :class:`Communicator` is a set of ranks with a name: the whole world, the
ranks of this host, the ranks holding the same place on every host (one per
host), or any list of ranks. Every operation takes one tensor or a list of
tensors, works in place (the default) or returns new tensors, and either
waits (the default) or returns a :class:`Handle` whose ``wait()`` gives the
result, so that communication can overlap computation. Nothing here
re-implements a collective: each call is one ``torch.distributed`` call per
tensor; "mean" is a sum divided after the wait (gloo has no average).

Every communicator counts the bytes this rank sends (:attr:`Communicator.bytes_sent`),
estimated for the usual algorithms: a ring all-reduce sends ``2 (P-1)/P`` of
the tensor, an all-gather ``(P-1)`` times its input, a reduce-scatter ``(P-1)/P``
of its input, a broadcast its tensor from the source only, a send its tensor.

Example:
    >>> from autodist import comm
    >>> grads = [p.grad for p in model.parameters()]
    >>> handle = comm.all_reduce(grads, "mean", async_op=True)   # starts, returns at once
    >>> ...                                                      # compute meanwhile
    >>> handle.wait()                                            # grads now averaged over the world
    >>> node = comm.host()                                       # the ranks of this machine
    >>> comm.broadcast(model_state, src=0, comm=node)            # from the host's first rank

Note:
    Communicators are collective to create: every rank of the world must ask
    for the same ones in the same order (``torch.distributed.new_group`` is).
    In a world of one (no launcher) every operation returns at once, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Literal, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from autodist.runtime.position import waiting
from autodist.runtime.world import World, init, new_group

# The flat collectives (one tensor in, one out, ranks' parts concatenated) are named *_single from torch 2.13 on,
# which deprecates the older names; torch 2.4 to 2.12 (this package supports 2.4 on) have only the older ones.
reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
Reduce = Literal["sum", "mean"]
T = TypeVar("T")


def carrier(device: torch.device, group: Any = None) -> torch.device:
    """Where a point-to-point send or receive over ``group`` carries tensors that live on ``device``: gloo's take
    CPU tensors only (a CUDA one fails, "Bad address"; gloo's collectives take CUDA ones), so on ranks that share a
    GPU they go through host memory; elsewhere ``device`` itself.

    Example:
        >>> carrier(torch.device("cuda:0"))   # under gloo
        device(type='cpu')
    """
    if device.type == "cpu" or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return device
    return torch.device("cpu")


@dataclass(eq=False)
class Communicator:
    """A named set of ranks. ``ranks`` are global ranks in the communicator's order; ``rank`` is this
    process's index among them (None when it is not a member).

    Example:
        >>> c = comm.custom([0, 2])
        >>> c.name, c.size, c.ranks
        ('ranks [0, 2]', 2, (0, 2))
    """

    name: str
    ranks: tuple[int, ...]
    group: Any  # a torch ProcessGroup; None for torch's default group or a world of one
    rank: int | None
    bytes_sent: float = field(default=0.0)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """The world rank of the communicator's member ``index``."""
        if not 0 <= index < self.size:
            raise ValueError(f"communicator {self.name!r} has {self.size} members (0..{self.size - 1}); "
                             f"got member {index}")
        return self.ranks[index]

    def _check_member(self, what: str) -> None:
        if self.rank is None:
            raise ValueError(f"{what}: this rank ({dist.get_rank()}) is not in communicator {self.name!r} "
                             f"(ranks {list(self.ranks)}); call it only on its members")


class Handle(Generic[T]):
    """An operation under way. ``wait()`` blocks until it completes and returns its result.

    Example:
        >>> h = comm.all_reduce(t, async_op=True)
        >>> h.is_completed()    # maybe not yet
        >>> t = h.wait()
    """

    def __init__(self, works: list[Any], finish: Callable[[], T], words: str) -> None:
        self._works, self._finish, self._words = works, finish, words
        self._done = False
        self._result: T | None = None

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> T:
        if not self._done:
            with waiting(self._words):
                for work in self._works:
                    work.wait()
            self._result, self._done = self._finish(), True
            self._works = []
        return self._result  # type: ignore[return-value]


# -- communicators ---------------------------------------------------------------------------------

_cache: dict[tuple[int, ...], Any] = {}
_communicators: dict[tuple[str, tuple[int, ...]], Communicator] = {}


def _group_for(ranks: tuple[int, ...], world: World) -> Any:
    """The process group of ``ranks``, made once; every rank must ask for every group, in the same order."""
    if ranks == tuple(range(world.size)):
        return None
    if ranks not in _cache:
        _cache[ranks] = new_group(list(ranks))
    return _cache[ranks]


def _make(name: str, ranks: Sequence[int], world: World) -> Communicator:
    """The communicator ``name`` over ``ranks``: the same object (and byte counter) each time it is asked for."""
    ranks = tuple(ranks)
    key = (name, ranks)
    if key not in _communicators:
        group = _group_for(ranks, world) if world.size > 1 else None
        _communicators[key] = Communicator(name, ranks, group, ranks.index(world.rank) if world.rank in ranks else None)
    return _communicators[key]


def world() -> Communicator:
    """Every rank of the job."""
    w = init()
    return _make("world", range(w.size), w)


def _hosts(ranks_per_host: int | None, world_: World) -> int:
    k = world_.local_size if ranks_per_host is None else ranks_per_host
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or world_.size % k:
        raise ValueError(f"ranks_per_host must be a positive int dividing the {world_.size} ranks, got {k!r}")
    if ranks_per_host is None and world_.rank % k != world_.local_rank:
        raise ValueError(f"rank {world_.rank} is local rank {world_.local_rank} of {k} on its host, so hosts do not "
                         f"hold consecutive ranks; pass ranks_per_host, or build the sets with comm.custom")
    return k


def host(ranks_per_host: int | None = None) -> Communicator:
    """The ranks of this host: consecutive blocks of ``ranks_per_host`` (default: the launcher's local size).

    Every rank makes every host's group (a collective call), and gets its own.
    """
    w = init()
    k = _hosts(ranks_per_host, w)
    mine = None
    for h in range(w.size // k):
        c = _make(f"host {h}", range(h * k, (h + 1) * k), w)
        mine = c if c.rank is not None else mine
    assert mine is not None
    return mine


def across_hosts(ranks_per_host: int | None = None) -> Communicator:
    """One rank per host: those holding this rank's place (local rank) on every host."""
    w = init()
    k = _hosts(ranks_per_host, w)
    mine = None
    for local in range(k):
        c = _make(f"local rank {local} of every host", range(local, w.size, k), w)
        mine = c if c.rank is not None else mine
    assert mine is not None
    return mine


def custom(ranks: Sequence[int], name: str | None = None) -> Communicator:
    """Any set of world ranks, in the given order; every rank of the world must call it with the same list.

    On a rank outside ``ranks`` it returns a communicator with ``rank=None`` whose operations raise.
    """
    w = init()
    listed = list(ranks)
    if not listed or len(set(listed)) != len(listed) or any(not isinstance(r, int) or not 0 <= r < w.size
                                                              for r in listed):
        raise ValueError(f"ranks must be distinct world ranks in 0..{w.size - 1}, got {listed!r}")
    return _make(name or f"ranks {listed}", listed, w)


def of_group(group: Any, name: str) -> Communicator:
    """A communicator over an existing process group (None: the whole world)."""
    w = init()
    if group is None or w.size == 1:
        return Communicator(name, tuple(range(w.size)), None, w.rank)
    ranks = tuple(dist.get_process_group_ranks(group))
    return Communicator(name, ranks, group, ranks.index(w.rank) if w.rank in ranks else None)


# -- operations ------------------------------------------------------------------------------------

def _as_list(tensors: Tensors, what: str) -> tuple[list[torch.Tensor], bool]:
    if isinstance(tensors, torch.Tensor):
        return [tensors], True
    listed = list(tensors)
    bad = [type(t).__name__ for t in listed if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"comm.{what} takes a tensor or a list of tensors, got a list holding {bad[0]}")
    return listed, False


def _finish(works: list[Any], result: Callable[[], T], async_op: bool, words: str) -> T | Handle[T]:
    handle = Handle(works, result, words)
    return handle if async_op else handle.wait()


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def ring_bytes(tensors: list[torch.Tensor], size: int) -> float:
    """What one rank sends to all-reduce ``tensors`` over ``size`` ranks by a ring: 2(P-1)/P x their bytes.

    Example:
        >>> ring_bytes([torch.zeros(256)], size=2)   # 1 KiB over 2 ranks
        1024.0
    """
    return 2 * (size - 1) / size * _nbytes(tensors)


def all_reduce(tensors: Tensors, op: Reduce = "sum", *, comm: Communicator | None = None, inplace: bool = True,
               async_op: bool = False) -> Any:
    """Sum (or average) each tensor over the communicator's ranks.

    Returns the reduced tensor(s) (the inputs themselves when ``inplace``), or a
    :class:`Handle` giving them with ``async_op=True``.

    Example:
        >>> comm.all_reduce([w1, w2], "mean")    # w1, w2 now the average over the world
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"comm.all_reduce: op must be 'sum' or 'mean', got {op!r}")
    comm = comm or world()
    comm._check_member("comm.all_reduce")
    ts, single = _as_list(tensors, "all_reduce")
    ts = ts if inplace else [t.clone() for t in ts]
    works = [] if comm.size == 1 else [dist.all_reduce(t, group=comm.group, async_op=True) for t in ts]
    comm.bytes_sent += ring_bytes(ts, comm.size)

    def result() -> Any:
        if op == "mean" and comm.size > 1:
            for t in ts:
                t.div_(comm.size)
        return ts[0] if single else ts
    return _finish(works, result, async_op, f"autodist.comm.all_reduce over {comm.name!r}")


def broadcast(tensors: Tensors, src: int = 0, *, comm: Communicator | None = None, inplace: bool = True,
              async_op: bool = False) -> Any:
    """Every member gets member ``src``'s tensor(s) (``src`` counts within the communicator).

    Example:
        >>> comm.broadcast(list(model.parameters()), src=0, comm=comm.host())
    """
    comm = comm or world()
    comm._check_member("comm.broadcast")
    source = comm.global_rank(src)
    ts, single = _as_list(tensors, "broadcast")
    ts = ts if inplace else [t.clone() for t in ts]
    works = [] if comm.size == 1 else [dist.broadcast(t, source, group=comm.group, async_op=True) for t in ts]
    comm.bytes_sent += _nbytes(ts) if comm.rank == src and comm.size > 1 else 0
    return _finish(works, lambda: ts[0] if single else ts, async_op,
                   f"autodist.comm.broadcast from member {src} over {comm.name!r}")


def all_gather(tensors: Tensors, *, comm: Communicator | None = None, async_op: bool = False) -> Any:
    """Each member's tensor(s), from every member: a list of ``comm.size`` tensors per input tensor.

    Example:
        >>> losses = comm.all_gather(loss.detach())    # [loss of member 0, loss of member 1, ...]
    """
    comm = comm or world()
    comm._check_member("comm.all_gather")
    ts, single = _as_list(tensors, "all_gather")
    outs = [[torch.empty_like(t) for _ in range(comm.size)] for t in ts]
    if comm.size == 1:
        for t, out in zip(ts, outs):
            out[0].copy_(t)
    works = [] if comm.size == 1 else [dist.all_gather(out, t.contiguous(), group=comm.group, async_op=True)
                                       for t, out in zip(ts, outs)]
    comm.bytes_sent += (comm.size - 1) * _nbytes(ts)
    return _finish(works, lambda: outs[0] if single else outs, async_op,
                   f"autodist.comm.all_gather over {comm.name!r}")


def reduce_scatter(tensors: Tensors, op: Reduce = "sum", *, comm: Communicator | None = None,
                   async_op: bool = False) -> Any:
    """Reduce each tensor over the members and give member i its i-th chunk along dim 0.

    Each tensor's first dimension must divide by ``comm.size``.

    Example:
        >>> mine = comm.reduce_scatter(torch.arange(4.0))   # on 2 ranks: rank 0 gets [0, 2], rank 1 [4, 6]
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"comm.reduce_scatter: op must be 'sum' or 'mean', got {op!r}")
    comm = comm or world()
    comm._check_member("comm.reduce_scatter")
    ts, single = _as_list(tensors, "reduce_scatter")
    for t in ts:
        if t.ndim == 0 or t.shape[0] % comm.size:
            raise ValueError(f"comm.reduce_scatter: a tensor of shape {tuple(t.shape)} cannot be cut into "
                             f"{comm.size} equal chunks along dim 0; pad it to a multiple of {comm.size}")
    outs = [t.chunk(comm.size)[comm.rank].clone() for t in ts]  # type: ignore[index]
    works = [] if comm.size == 1 else [
        dist.reduce_scatter(out, [c.contiguous() for c in t.chunk(comm.size)], group=comm.group, async_op=True)
        for t, out in zip(ts, outs)]
    comm.bytes_sent += (comm.size - 1) / comm.size * _nbytes(ts)

    def result() -> Any:
        if op == "mean" and comm.size > 1:
            for out in outs:
                out.div_(comm.size)
        return outs[0] if single else outs
    return _finish(works, result, async_op, f"autodist.comm.reduce_scatter over {comm.name!r}")


def _peer(comm: Communicator, member: int, verb: str) -> int:
    if member == comm.rank:
        raise ValueError(f"comm: member {member} of {comm.name!r} cannot {verb} itself")
    return comm.global_rank(member)


def send(tensors: Tensors, dst: int, *, comm: Communicator | None = None, async_op: bool = False) -> Any:
    """Send the tensor(s) to member ``dst``, which must :func:`recv` as many tensors of the same shapes.

    Example:
        >>> h = comm.send(x, dst=1, async_op=True); ...; h.wait()
    """
    comm = comm or world()
    comm._check_member("comm.send")
    peer = _peer(comm, dst, "send to")
    # kept alive by the handle until sent; through host memory where gloo cannot send a CUDA tensor
    ts = [t.to(carrier(t.device, comm.group)).contiguous() for t in _as_list(tensors, "send")[0]]
    works = [dist.isend(t, peer, group=comm.group) for t in ts]
    comm.bytes_sent += _nbytes(ts)
    return _finish(works, lambda: ts and None, async_op, f"autodist.comm.send to member {dst} of {comm.name!r}")


def recv(tensors: Tensors, src: int, *, comm: Communicator | None = None, async_op: bool = False) -> Any:
    """Receive into the tensor(s), in place, what member ``src`` sends.

    Example:
        >>> x = comm.recv(torch.empty(3), src=0)
    """
    comm = comm or world()
    comm._check_member("comm.recv")
    peer = _peer(comm, src, "receive from")
    ts, single = _as_list(tensors, "recv")
    bad = [tuple(t.shape) for t in ts if not t.is_contiguous()]
    if bad:
        raise ValueError(f"comm.recv receives in place and needs contiguous tensors; one of shape {bad[0]} is not")
    buffers = [t if carrier(t.device, comm.group) == t.device else torch.empty_like(t, device="cpu") for t in ts]
    works = [dist.irecv(b, peer, group=comm.group) for b in buffers]

    def received() -> Any:
        for t, b in zip(ts, buffers):
            if b is not t:  # through host memory (gloo): into the tensor given, in place
                t.copy_(b)
        return ts[0] if single else ts
    return _finish(works, received, async_op, f"autodist.comm.recv from member {src} of {comm.name!r}")
