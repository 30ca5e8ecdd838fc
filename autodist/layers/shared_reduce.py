"""The model-parallel layers' all-reduce between the ranks of one machine, through shared memory.

Gloo sums a tensor between two processes of one machine through TCP on
loopback. The MP layers all-reduce activations (forward) and input gradients
(backward) of a few MB at every step, each right after a GEMM, where gloo's
all-reduce of 1 MiB took 3.3-3.5 ms inside a training step on 2 ranks of a
2-core machine, this way 1.6-2.4 ms. Here the tensor is copied into this
rank's slot of a file every rank of the group maps
(:mod:`autodist.runtime.shared_slots`); a fence says every slot is written
(:mod:`autodist.runtime.shared_fence`: microseconds in the file on x86-64,
gloo's one-number all-reduce elsewhere); rank r adds up part r of every slot,
in rank order, into every slot; a second fence says every slot holds the sum,
and the tensor takes its slot's: the same bits on every rank, as after gloo's
all-reduce.

Chosen per process group at its first all-reduce (a collective: every rank of
the group is in it): shared memory where the group is gloo on one machine and
may share memory (``AUTODIST_SHARED_MEMORY``), the backend's all-reduce
otherwise, and always for a tensor that is not a contiguous CPU floating-point
one and inside a forward that ``torch.compile`` traces. The slots grow (a new
file, made by every rank in the same all-reduce) when a tensor outgrows them.

Example:
    >>> all_reduce(partial, group)   # in place, as dist.all_reduce(partial, group=group)
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from autodist.runtime.held import Held
from autodist.runtime.position import waiting
from autodist.runtime.shared_slots import Shared, part_pieces, shared_slots, sum_into_every_slot

WAIT = "a model-parallel layer's all-reduce (in shared memory)"  # in the watchdog's words
SMALLEST_BYTES = 4 << 20  # the slots' first size: a few activations of a small model
# a few numbers a step (a count, a loss term's or BatchNorm's statistics), in files of their own: the
# activations' grow to what the largest layer sends, which a data-parallel model would otherwise pay for
SUMS_BYTES = 64 << 10
PURPOSES = {"activations": (SMALLEST_BYTES, "model-parallel all-reduces"),
            "sums": (SUMS_BYTES, "data-parallel sums of counts and statistics")}


class SharedAllReduce:
    """One slot of ``capacity`` bytes per rank of ``group``, in shared memory every rank maps."""

    def __init__(self, shared: Shared, group: dist.ProcessGroup | None) -> None:
        self.slots, self.mapping, self.fence = shared.slots[0], shared.mapping, shared.fence  # views of the mapping
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.capacity = self.slots[0].numel()

    @classmethod
    def open(cls, group: dist.ProcessGroup | None, capacity: int,
             what: str = "model-parallel all-reduces") -> SharedAllReduce | None:
        """Slots of ``capacity`` bytes, or None where the group cannot share memory. A collective over ``group``."""
        shared = shared_slots([torch.empty(capacity, dtype=torch.uint8)], group, what)
        return None if shared is None else cls(shared, group)

    def held(self, held: Held) -> None:
        held.share(self.mapping, self.size)

    def __call__(self, t: torch.Tensor) -> None:
        n, nbytes = t.numel(), t.numel() * t.element_size()
        slots = [slot[:nbytes].view(t.dtype) for slot in self.slots]
        flat = t.view(-1)
        slots[self.rank].copy_(flat)
        # Until the second fence each rank writes its part of the sum into every slot; after it, nobody
        # writes into another rank's slot until every rank has passed the next all-reduce's first.
        with waiting(WAIT):  # the watchdog names a rank that never arrives, or died
            self.fence.wait()  # every slot is written
            sum_into_every_slot(slots, part_pieces(n, self.rank, self.size, t.element_size()))
            self.fence.wait()  # every slot holds the whole sum
        flat.copy_(slots[self.rank])


# per purpose and process group (the default group's object for None), the way its all-reduces go; None:
# the backend's
_chosen: "dict[str, weakref.WeakKeyDictionary[Any, SharedAllReduce | None]]" = {
    purpose: weakref.WeakKeyDictionary() for purpose in PURPOSES}


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, purpose: str = "activations") -> None:
    """``dist.all_reduce(t, group=group)`` (a sum, in place), through shared memory where the group can.

    ``purpose``: "activations" (a model-parallel layer's, slots from 4 MiB) or "sums" (a few numbers a step,
    slots from 64 KiB): each has its own file per group, grown to its own largest tensor.

    Example:
        >>> all_reduce(partial, None)              # every rank of the default group, tensors of one shape
        >>> all_reduce(count, dp_group, "sums")
    """
    if not _shareable(t):
        dist.all_reduce(t, group=group)
        return
    key = dist.group.WORLD if group is None else group
    nbytes = t.numel() * t.element_size()
    chosen, (smallest, what) = _chosen[purpose], PURPOSES[purpose]
    reducer = chosen.get(key, False)
    if reducer is False or (reducer is not None and reducer.capacity < nbytes):
        grown = 2 * nbytes if reducer else nbytes  # every rank of the group sees the same size here
        reducer = chosen[key] = SharedAllReduce.open(group, max(smallest, grown), what)
    if reducer is None:
        dist.all_reduce(t, group=group)
    else:
        reducer(t)


def held_bytes(group: dist.ProcessGroup | None, purpose: str = "activations") -> float:
    """Bytes this rank holds for ``group``'s shared-memory all-reduce (its share of the file), 0 where none
    was opened yet. The slots grow with the largest all-reduce and stay: a later model on the same group
    finds them as large."""
    reducer = reducer_of(group, purpose)
    return 0.0 if reducer is None else len(reducer.mapping) / reducer.size


def reducer_of(group: dist.ProcessGroup | None, purpose: str = "activations") -> SharedAllReduce | None:
    """The shared-memory all-reduce ``group`` uses for ``purpose``, once its first all-reduce chose it."""
    found = _chosen[purpose].get(dist.group.WORLD if group is None else group)
    return found or None


def _shareable(t: torch.Tensor) -> bool:
    """The same answer on every rank of a group: the tensors of one all-reduce have one dtype, shape, device."""
    return t.device.type == "cpu" and t.is_floating_point() and t.is_contiguous() and t.numel() > 0 \
        and not torch.compiler.is_compiling()
