"""How a sync's gradient buckets are summed over the data-parallel ranks; chosen once per bucket layout.

* :class:`AllReduce`: one asynchronous ``all_reduce`` of the backend (gloo,
  NCCL) per bucket, started as soon as the bucket is full, so that it overlaps
  the rest of backward.
* :class:`SharedSum`: every rank of the group on one machine, CPU buckets under
  gloo. Gloo moves a tensor between two processes of one machine through TCP on
  loopback, every byte copied into the kernel and out again on both sides at
  every step of its ring. Here every rank maps one shared file instead
  (:mod:`autodist.shared_memory`): a rank packs each full bucket into its own
  slot there, one all-reduce of a single number at the end of backward says
  that every slot is written, and each rank adds the slots up, in rank order,
  into its own bucket. Every rank does the same additions in the same order, so
  all hold the same bits, as after gloo's all-reduce. Another one-number
  all-reduce, started without waiting, says that every rank has read the
  slots; the next sync waits for it before writing into them again.
  The packing happens during backward, as buckets fill; the adding up after
  it, so none of the sum overlaps backward (where every core computes, as on
  the benchmark machine, gloo's thread would compete for them anyway). The
  slots are memory on top of each rank's buckets: the machine holds its
  gradient buffers twice. On 2 ranks of a 2-core machine a 2.8 MB bucket is summed in 1.4 ms against
  gloo's 3.3 ms, 40 MB in 11 ms against 37 ms (``benchmarks/bench_exchange.py``).

:func:`choose` takes shared memory when every rank of the group is on this
machine as the launcher placed it (:func:`autodist.runtime.machine`), every rank
could map the file the group's first rank made (the final word on "one
machine"), the group has at most :data:`MAX_RANKS` ranks, the slots (ranks x
bucket bytes) fit in half of ``/dev/shm``'s free space and of the memory still
available, and ``AUTODIST_SHARED_MEMORY`` is not 0; the backend's all-reduce
otherwise. ``parallelize``'s summary line says "through shared memory" where it is
used; where it would have been but the group is too large or the file could not
be made or mapped, group rank 0 logs why.

Example:
    >>> exchange = choose([b.flat for b in buckets], group)   # every rank of the group, the same buckets
    >>> for i, bucket in enumerate(buckets):                  # in order, as each fills during backward
    ...     exchange.writable()                                # waits only where the slots are still read
    ...     exchange.outbox(i, bucket.flat).copy_(mine[i])     # this rank's part
    ...     exchange.send(i, bucket.flat)
    >>> exchange.finish()                                      # each flat now holds the sum over the ranks
"""
from __future__ import annotations

import mmap
from typing import Any, Union

import torch
import torch.distributed as dist

from autodist import shared_memory
from autodist.runtime import log, machine, shared_memory_allowed
from autodist.watchdog import waiting


class AllReduce:
    """The backend's asynchronous all-reduce, one per bucket."""

    name = "all-reduce"

    def __init__(self, flats: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.works: list[Any] = [None] * len(flats)

    def outbox(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where bucket ``index`` is packed: the bucket itself, summed in place."""
        return flat

    def writable(self) -> None:
        """The outboxes may be written (always: each all-reduce ended before its bucket is packed again)."""

    def send(self, index: int, flat: torch.Tensor) -> None:
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


class SharedSum:
    """Buckets summed through a file of shared memory mapped by every rank of the group (this machine's)."""

    name = "shared memory"

    def __init__(self, flats: list[torch.Tensor], slots: list[list[torch.Tensor]], rank: int,
                 group: dist.ProcessGroup | None, mapping: mmap.mmap) -> None:
        self.flats, self.slots, self.rank, self.group = flats, slots, rank, group
        self.mapping = mapping  # the slots are views of it
        self.written = torch.zeros(1)
        self.read = torch.zeros(1)
        self.reading: Any = None  # the others are still reading the last sync's slots until this completes

    def outbox(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where bucket ``index`` is packed: this rank's slot, so that sending copies nothing."""
        return self.slots[index][self.rank]

    def writable(self) -> None:
        """Return once every rank has read the slots of the last sync, so that they may be written again."""
        pending, self.reading = self.reading, None
        if pending is None or pending.is_completed():
            pending is not None and pending.wait()  # raises if it failed
            return
        with waiting("slots"):  # a rank that died meanwhile is named, not waited for
            pending.wait()

    def send(self, index: int, flat: torch.Tensor) -> None:
        """Nothing to do: the bucket was packed into this rank's slot."""

    def finish(self) -> None:
        dist.all_reduce(self.written.zero_(), group=self.group)  # every rank has written every slot
        self._add_up()
        self.reading = dist.all_reduce(self.read.zero_(), group=self.group, async_op=True)

    def _add_up(self) -> None:
        """Each bucket becomes the sum of the ranks' slots, added in rank order (the same bits everywhere)."""
        for slots, flat in zip(self.slots, self.flats):
            torch.add(slots[0], slots[1], out=flat)
            for slot in slots[2:]:
                flat.add_(slot)

    def abandon(self) -> None:
        """A backward failed midway: what it wrote into the slots is overwritten by the next sync."""


Exchange = Union[AllReduce, SharedSum]
MAX_RANKS = 8  # more ranks on one machine: gloo (measured here up to 4, each at half of gloo's time or less)


def choose(flats: list[torch.Tensor], group: dist.ProcessGroup | None) -> Exchange:
    """Shared memory where the group is on one machine and can map one file, the backend's all-reduce
    otherwise. A collective over ``group``: every rank calls it with buckets of the same sizes."""
    size = dist.get_world_size(group)
    if size < 2 or not flats or dist.get_backend(group) != "gloo":
        return AllReduce(flats, group)
    wish = (machine(), shared_memory_allowed() and shared_memory.available(),
            all(f.device.type == "cpu" for f in flats))
    wishes: list[Any] = [None] * size
    dist.all_gather_object(wishes, wish, group=group)
    if len({w[0] for w in wishes}) > 1 or not all(w[1] and w[2] for w in wishes):
        return AllReduce(flats, group)
    if size > MAX_RANKS:
        if dist.get_rank(group) == 0:
            log.info("gradient buckets go through gloo's all-reduce, not shared memory: %d ranks on this machine; "
                     "each rank adds up every rank's slot, so the memory read grows with the ranks squared, and "
                     "beyond %d ranks it was not measured to beat gloo", size, MAX_RANKS)
        return AllReduce(flats, group)
    shared = _open(flats, group, size)
    return shared if shared is not None else AllReduce(flats, group)


def _open(flats: list[torch.Tensor], group: dist.ProcessGroup | None, size: int) -> SharedSum | None:
    """Group rank 0 makes the file, every rank maps it, and shared memory is used only if all could."""
    me = dist.get_rank(group)
    strides = [shared_memory.aligned(f.numel() * f.element_size()) for f in flats]
    nbytes = size * sum(strides)
    made: list[Any] = list(shared_memory.make(nbytes)) if me == 0 else [None, ""]
    path, why = made
    try:
        dist.broadcast_object_list(made, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        path, why = made
        mapping = None
        if path is not None:
            try:
                mapping = shared_memory.map_file(path, nbytes)
            except OSError as e:  # another machine's file system (rank 0 speaks for the others below)
                why = f"this rank cannot map the file it made ({e})" if me == 0 else why
        mapped = torch.tensor([0.0 if mapping is None else 1.0])
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)
    finally:  # removed as soon as every rank has it mapped, or on any error: nothing is left in /dev/shm
        if me == 0 and path is not None:
            shared_memory.remove(path)
    if mapped.item() < 1.0:
        if me == 0:
            log.info("gradient buckets go through gloo's all-reduce, not shared memory: %s",
                     why or "another rank could not open the file this rank made in shared memory")
        return None
    assert mapping is not None
    slots, offset = [], 0
    for flat, stride in zip(flats, strides):
        slots.append([torch.frombuffer(mapping, dtype=flat.dtype, count=flat.numel(), offset=offset + r * stride)
                      for r in range(size)])
        offset += size * stride
    if me == 0:
        log.debug("the %d ranks on this machine sum their gradient buckets through shared memory (%.1f MiB in %s)",
                  size, nbytes / 2**20, shared_memory.DIRECTORY)
    return SharedSum(flats, slots, me, group, mapping)
