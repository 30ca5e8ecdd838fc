"""Slots of shared memory for the ranks of one machine, and summing them in place: one file every rank maps.

:func:`shared_slots` gives every rank of a group one slot per buffer in one
file of shared memory (:mod:`autodist.runtime.shared_memory`) that all of them
map, where the group is gloo on CPU and every rank is on this machine as the
launcher placed it (:func:`autodist.runtime.environment.machine`), could map the
file the group's first rank made (the final word on "one machine"), and
``AUTODIST_SHARED_MEMORY`` is not 0; None otherwise, with group rank 0 logging
why where the file could not be made or mapped. :func:`sum_into_every_slot`
is the sum that the gradient buckets (:mod:`autodist.dp.exchange`) and the
model-parallel layers' all-reduce (:mod:`autodist.layers.shared_reduce`) share:
rank r adds up part r of every rank's slot, in rank order, and writes it into
part r of every slot, piece by piece so that the writes find the sum in cache.

Example:
    >>> shared = shared_slots([bucket], group, "gradient buckets")   # a collective; or None
    >>> shared.slots[0][rank].copy_(mine)                            # every rank its own slot
    >>> shared.fence.wait()                                          # every slot is written
    >>> sum_into_every_slot(shared.slots[0], part_pieces(bucket.numel(), rank, size, 4))
    >>> shared.fence.wait()                                          # every slot holds the sum
"""
from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from autodist.runtime import plain, shared_fence, shared_memory
from autodist.runtime.environment import machine, shared_memory_allowed
from autodist.runtime.world import log

PIECE_BYTES = 256 << 10  # a piece of each of two slots fits a core's L2 cache with room to spare


class Shared(NamedTuple):
    """What :func:`shared_slots` gives: ``slots[i][r]``, rank r's slot for buffer i; the mapping the slots are
    views of (keep it); the fence that orders the phases of a sum."""

    slots: list[list[torch.Tensor]]
    mapping: mmap.mmap
    fence: shared_fence.Fence


def part(n: int, rank: int, size: int) -> tuple[int, int]:
    """Part ``rank`` of ``n`` numbers over ``size`` ranks: the numbers [lo, hi) that rank sums.

    Example:
        >>> part(10, 1, 3)
        (3, 6)
    """
    return n * rank // size, n * (rank + 1) // size


def part_pieces(n: int, rank: int, size: int, element_size: int) -> list[tuple[int, int]]:
    """:func:`part` ``rank`` of ``n`` numbers over ``size`` ranks in pieces of at most PIECE_BYTES.

    Example:
        >>> part_pieces(10, 1, 2, 4)
        [(5, 10)]
    """
    lo, hi = part(n, rank, size)
    step = max(1, PIECE_BYTES // element_size)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def sum_into_every_slot(slots: list[torch.Tensor], pieces: list[tuple[int, int]]) -> None:
    """Each piece of every slot = that piece of every rank's slot, added in rank order (the same bits on every
    rank); in place, so every slot holds the sum of the pieces."""
    first, rest = slots[0], slots[1:]
    for lo, hi in pieces:
        out = first[lo:hi]
        for slot in rest:
            out.add_(slot[lo:hi])
        for slot in rest:
            slot[lo:hi].copy_(out)


class Own(NamedTuple):
    """Numbers [lo, hi) of this rank's part of a slot, when its slot does not hold them: where they are read
    (``source``, to be multiplied by ``scale``) and where their sum goes (``home``; may be ``source`` itself)."""

    lo: int
    hi: int
    source: torch.Tensor
    home: torch.Tensor
    scale: float


def sum_from_own(slots: list[torch.Tensor], rank: int, own: list[Own], scratch: torch.Tensor) -> None:
    """:func:`sum_into_every_slot` of this rank's part, its own numbers read from ``own`` and their sum left
    there, in the other ranks' slots and in ``home``. The same bits: the ranks' numbers added in rank order,
    but for the first two, whose addition commutes. Written where the numbers were just read, so that no
    line is fetched only to be overwritten: on ranks 0 and 1 the sum builds up in ``home`` (in the gradient
    itself where it is its source); on a later rank its own numbers wait in ``scratch`` (a cache-sized piece)
    while the sum of the ranks before it builds up in ``home``."""
    for lo, hi, source, home, scale in own:
        theirs = [slot[lo:hi] for slot in slots]
        if rank <= 1:  # a + b is b + a, bit for bit
            first = theirs[1 - rank]
            if scale == 1.0:
                torch.add(source, first, out=home)
            else:
                torch.mul(source, scale, out=home)
                home.add_(first)
        else:
            mine = scratch[:hi - lo]
            torch.mul(source, scale, out=mine) if scale != 1.0 else mine.copy_(source)
            torch.add(theirs[0], theirs[1], out=home)
            theirs[rank] = mine
        for k in range(2, len(slots)):
            home.add_(theirs[k])
        for k, slot in enumerate(slots):
            if k != rank:
                slot[lo:hi].copy_(home)


def shared_slots(flats: list[torch.Tensor], group: dist.ProcessGroup | None, what: str) -> Shared | None:
    """One slot per rank of ``group`` for each of ``flats`` (each rank's, the same sizes), in a file of shared
    memory every rank maps, with the fence that orders a sum's phases; None where the ranks are not on one
    machine or cannot share a file (then use the backend; ``what`` goes through it, in words, for the log line
    saying why). A collective over ``group``."""
    return _open(flats, group, dist.get_world_size(group), what) if _one_machine(flats, group) else None


def _one_machine(flats: list[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` is on this machine, gloo, with CPU ``flats``, and may share memory. A
    collective over ``group``."""
    if dist.get_world_size(group) < 2 or not flats or dist.get_backend(group) != "gloo":
        return False
    wish = (machine(), shared_memory_allowed() and shared_memory.available(),
            all(f.device.type == "cpu" for f in flats))
    wishes = plain.all_gather(wish, group)
    return len({w[0] for w in wishes}) == 1 and all(w[1] and w[2] for w in wishes)


def _open(flats: list[torch.Tensor], group: dist.ProcessGroup | None, regions: int, what: str) -> Shared | None:
    """Group rank 0 makes the file (the fence's lines, then ``regions`` views of each flat), every rank maps it
    and announces itself to the fence, and shared memory is used only if all could."""
    me = dist.get_rank(group)
    strides = [shared_memory.aligned(f.numel() * f.element_size()) for f in flats]
    header = shared_memory.aligned(shared_fence.fence_bytes(regions))
    nbytes = header + regions * sum(strides)
    made: list[Any] = list(shared_memory.make(nbytes)) if me == 0 else [None, ""]
    path, why = made
    try:
        path, why = plain.broadcast(made, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        mapping = None
        if path is not None:
            try:
                mapping = shared_memory.map_file(path, nbytes)
            except OSError as e:  # another machine's file system (rank 0 speaks for the others below)
                why = f"this rank cannot map the file it made ({e})" if me == 0 else why
        if mapping is not None:
            shared_fence.announce(mapping, 0, me)
        mapped = torch.tensor([0.0 if mapping is None else 1.0])
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)
    finally:  # removed as soon as every rank has it mapped, or on any error: nothing is left in /dev/shm
        if me == 0 and path is not None:
            shared_memory.remove(path)
    if mapped.item() < 1.0:
        if me == 0:
            log.info("%s go through gloo, not shared memory: %s", what,
                     why or "another rank could not open the file this rank made in shared memory")
        return None
    assert mapping is not None
    views, offset = [], header
    for flat, stride in zip(flats, strides):
        views.append([torch.frombuffer(mapping, dtype=flat.dtype, count=flat.numel(), offset=offset + r * stride)
                      for r in range(regions)])
        offset += regions * stride
    if me == 0:
        log.debug("the ranks on this machine share %.1f MiB in %s", nbytes / 2**20, shared_memory.DIRECTORY)
    return Shared(views, mapping, shared_fence.choose(mapping, 0, group))
