"""How a sync's gradient buckets are summed over the data-parallel ranks; chosen once per bucket layout.

* :class:`AllReduce`: one asynchronous ``all_reduce`` of the backend (gloo,
  NCCL) per bucket, started as soon as the bucket is full, so that it overlaps
  the rest of backward.
* :class:`SharedSum`: every rank of the group on one machine, CPU buckets under
  gloo. Gloo moves a tensor between two processes of one machine through TCP on
  loopback, every byte copied into the kernel and out again on both sides at
  every step of its ring. Here the buckets themselves live in one file of
  shared memory that every rank maps (:mod:`autodist.runtime.shared_slots`): rank r's
  bucket is its slot r there, so packing writes straight into it. At the end of
  backward a fence (:mod:`autodist.runtime.shared_fence`: microseconds in the
  file itself on x86-64, gloo's one-number all-reduce elsewhere) says that
  every slot is packed; rank r adds up part r of every slot, in rank order, and
  writes the sum into part r of every slot (a reduce-scatter and an all-gather
  in one pass), piece by piece so that the writes find the sum in cache; a
  second fence says every slot holds the whole sum. Each part is added up once,
  by one rank, so every rank holds the same bits, as after gloo's all-reduce.
  After the second fence nobody writes into another rank's slot until every rank has
  entered the next sync, so what a rank does to its gradients after backward
  (clipping them in place, say) stays its own. Per rank and bucket of B bytes
  on N ranks, the sum reads B and writes B, whatever N; packing writes B more.
  Part r of rank r's slot is read by rank r alone, so after accumulation, where
  the sum is copied back into autograd's gradients, a large model's bucket
  leaves it out of packing and the sum makes it in the gradients themselves,
  which the copy back then skips (:mod:`autodist.dp.own_part`).
  Packing happens during backward, as buckets fill; the sum after it, so none
  of the sum overlaps backward (where every core computes, as on the benchmark
  machine, another thread would compete for them anyway). On 2 ranks of a
  2-core machine a bucket is summed in 0.1x of gloo's time at 1 MB, 0.26x at
  40 MB (``benchmarks/bench_exchange.py``).

:func:`choose` takes shared memory when every rank of the group is on this
machine as the launcher placed it (:func:`autodist.runtime.environment.machine`), every rank
could map the file the group's first rank made (the final word on "one
machine"), the buckets (ranks x bucket bytes) fit in half of ``/dev/shm``'s free
space and of the memory still available, and ``AUTODIST_SHARED_MEMORY`` is not
0; the backend's all-reduce otherwise. ``parallelize``'s summary line says
"through shared memory" where it is used; where it would have been but the file
could not be made or mapped, group rank 0 logs why.

Example:
    >>> exchange = choose([b.flat for b in buckets], group)   # every rank of the group, the same buckets
    >>> flats = [exchange.place(i, b.flat) for i, b in enumerate(buckets)]   # where each bucket lives now
    >>> for i, flat in enumerate(flats):                       # in order, as each fills during backward
    ...     flat.copy_(mine[i])                                # this rank's part
    ...     exchange.send(i, flat)
    >>> exchange.finish()                                      # each flat now holds the sum over the ranks
"""
from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist

from autodist.dp.own_part import OwnPart
from autodist.runtime.held import Held
from autodist.runtime.shared_slots import (PIECE_BYTES, Shared, part, part_pieces, shared_slots, sum_from_own,
                                           sum_into_every_slot)


class AllReduce:
    """The backend's asynchronous all-reduce, one per bucket."""

    name = "all-reduce"

    def __init__(self, flats: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.works: list[Any] = [None] * len(flats)

    def place(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where bucket ``index`` lives: where it is, summed in place."""
        return flat

    def claim(self, index: int) -> None:
        """Bucket ``index`` is about to be packed: its buffer is its own, nothing to wait for."""

    def own(self, index: int) -> tuple[int, int] | None:
        """No numbers of a bucket are summed on this rank alone: every one is packed."""
        return None

    def send(self, index: int, flat: torch.Tensor, own: OwnPart | None = None) -> None:
        self.works[index] = dist.all_reduce(flat, group=self.group, async_op=True)

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works = [None] * len(self.works)

    def abandon(self) -> None:
        """A backward failed midway (alike on every rank): wait for what it started, keep nothing."""
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = [None] * len(self.works)

    def held(self, held: Held) -> None:
        """Nothing of its own: the buckets are summed where they are."""


class SharedSum:
    """Buckets living in a file of shared memory mapped by every rank of the group, summed part by part into
    every rank's bucket."""

    name = "shared memory"

    def __init__(self, shared: Shared, rank: int) -> None:
        self.slots, self.rank = shared.slots, rank
        self.mapping, self.fence = shared.mapping, shared.fence  # the slots are views of the mapping
        size = len(self.slots[0]) if self.slots else 1
        self.pieces = [part_pieces(s[0].numel(), rank, size, s[0].element_size()) for s in self.slots]
        self.mine: list[OwnPart | None] = [None] * len(self.slots)
        self.scratch: dict[torch.dtype, torch.Tensor] = {}  # a piece: a later rank's own numbers (sum_from_own)

    def place(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where bucket ``index`` lives: this rank's slot, which the other ranks can read."""
        return self.slots[index][self.rank]

    def claim(self, index: int) -> None:
        """Bucket ``index`` is about to be packed: its slot is its own, nothing to wait for."""

    def own(self, index: int) -> tuple[int, int] | None:
        """The numbers [lo, hi) of bucket ``index`` that only this rank reads: its part of the sum."""
        return part(self.slots[index][0].numel(), self.rank, len(self.slots[index]))

    def send(self, index: int, flat: torch.Tensor, own: OwnPart | None = None) -> None:
        """Nothing to send: the bucket was packed where the other ranks read it; ``own``: where its own part
        is read from and summed, instead of its slot."""
        self.mine[index] = own

    def finish(self) -> None:
        # Between the two fences each rank writes its part of the sum into every rank's slot; after the
        # second, nobody writes into another rank's slot until every rank has entered the next sync's first.
        self.fence.wait()  # every rank has packed every bucket
        self._sum_my_parts()
        self.fence.wait()  # every part of every sum is in every slot

    def _sum_my_parts(self) -> None:
        """Part r of every slot = part r of every rank's slot, added in rank order."""
        for index, (slots, pieces) in enumerate(zip(self.slots, self.pieces)):
            mine, self.mine[index] = self.mine[index], None
            if mine is None:
                sum_into_every_slot(slots, pieces)
            else:
                sum_from_own(slots, self.rank, mine.split(pieces), self._scratch(slots[0]))

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A piece of ``like``'s dtype, which stays in cache from one piece to the next."""
        if like.dtype not in self.scratch:
            self.scratch[like.dtype] = like.new_empty(PIECE_BYTES // like.element_size())
        return self.scratch[like.dtype]

    def abandon(self) -> None:
        """A backward failed midway: what it packed is packed again by the next sync."""
        self.mine = [None] * len(self.mine)

    def held(self, held: Held) -> None:
        """The file every rank of the group maps, and the scratch pieces, for ``autodist.memory``."""
        held.share(self.mapping, len(self.slots[0]) if self.slots else 1)
        held.add("autodist buffers", *self.scratch.values())


Exchange = Union[AllReduce, SharedSum]


def choose(flats: list[torch.Tensor], group: dist.ProcessGroup | None) -> Exchange:
    """Shared memory where the group is on one machine and can map one file, the backend's all-reduce
    otherwise. A collective over ``group``: every rank calls it with buckets of the same sizes."""
    shared = shared_slots(flats, group, "gradient buckets")
    return AllReduce(flats, group) if shared is None else SharedSum(shared, dist.get_rank(group))
