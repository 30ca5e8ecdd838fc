"""A DataLoader over a stream (an ``IterableDataset``) split by rank: every rank reads the stream, each keeps its
slice of every global batch.

A stream has no indices to split, so each rank runs the user's own loader (its workers, its collate, its
``get_worker_info()`` split among them) and gets the very batches the single-process loader yields, then keeps
rows ``[lo, hi)`` of each (:func:`autodist.dp.handover.slice_bounds` along ``batch_dim``, the last partial batch
too: nothing padded, dropped or doubled) and hands them over with their share of the global batch, as the
map-style loader does, so the gradient is weighted exactly. No ``len()`` is needed and nothing of the stream
is kept beyond the batch in hand.

Each global batch is marked by a CRC-32 of its tensors' bytes, which the ranks compare at the gradient sync:
a stream that yields different batches on different ranks (a shuffle buffer without a seed) fails the first
step, naming the cause, instead of training on batches no single process would see.

The cost: every rank reads and collates the whole stream (N times the reading of one process), and computes
the CRC (one pass over each batch's bytes); nothing is sent.

Example:
    >>> loader = DataLoader(stream, batch_size=16, num_workers=2)
    >>> model, loader = autodist.parallelize(model, loader)   # each rank: its rows of each batch of 16
"""
from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from autodist.dp import elastic_data
from autodist.dp.handover import handed_over, slice_bounds
from autodist.dp.loader_position import Position, Resuming, pass_over
from autodist.faults import elastic, watchdog
from autodist.runtime import provenance
from autodist.runtime.provenance import BatchShare
from autodist.runtime.tree import leaves


def rows(batch: Any, lo: int, hi: int, dim: int = 0, n: int | None = None) -> Any:
    """Rows ``[lo, hi)`` of a collated batch of ``n`` samples: tensors and arrays along ``dim``, a list of
    strings or numbers (default_collate's form of them) as it is long, which must then be ``n`` where ``n`` is
    given; containers (tuple, list, mapping, namedtuple, dataclass) kept as they are around their rows."""
    if isinstance(batch, (torch.Tensor, np.ndarray)) and batch.ndim <= dim:
        return batch  # no rows (a per-batch number): every rank keeps it, as batch_size does not count it
    if isinstance(batch, torch.Tensor):
        return batch.narrow(dim, lo, hi - lo)
    if isinstance(batch, np.ndarray):
        return batch[(slice(None),) * dim + (slice(lo, hi),)]
    if isinstance(batch, Mapping):  # a dict, Hugging Face's BatchEncoding
        return type(batch)({k: rows(v, lo, hi, dim, n) for k, v in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: rows(getattr(batch, f.name), lo, hi, dim, n)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(rows(v, lo, hi, dim, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(v, (str, bytes, int, float, bool)) for v in batch):
            if n is not None and len(batch) != n:
                raise ValueError(f"a stream's batch holds a list of {len(batch)} plain values beside {n} samples "
                                 f"({batch[:4]!r}...): autodist splits such a list by rank as one entry a sample, "
                                 f"so it must have one per sample; make a per-batch value a tensor or a tuple "
                                 f"field of one value per sample")
            return batch[lo:hi]  # one entry a sample
        return type(batch)(rows(v, lo, hi, dim, n) for v in batch)
    return batch


def batch_size(batch: Any, dim: int = 0) -> int:
    """The number of samples of a collated batch: its tensors' (and arrays') size along ``dim``, which must
    agree; raises where it holds none or they differ."""
    sizes = {t.shape[dim] for t in _arrays(batch) if len(t.shape) > dim}
    if len(sizes) != 1:
        raise ValueError(f"autodist splits each batch of a stream by rank along dimension {dim} (batch_dim) of its "
                         f"tensors, but this batch's tensors have {sorted(sizes) or 'no'} sizes there "
                         f"({type(batch).__name__}); collate the stream's samples into tensors that share their "
                         f"batch dimension, or give parallelize(..., batch_dim=...)")
    return sizes.pop()


def _arrays(batch: Any) -> Iterator[Any]:
    """The tensors and arrays of a batch, in a fixed order (:func:`autodist.runtime.tree.leaves`)."""
    return (leaf for _, leaf in leaves(batch) if isinstance(leaf, (torch.Tensor, np.ndarray)))


def mark(batch: Any) -> int | None:
    """The identity of a global batch, from its content: a CRC-32 of its CPU tensors' and numeric arrays' bytes
    (None where it has none)."""
    crc, seen = 0, False
    for t in _arrays(batch):
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu":
                continue
            data = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()  # 0-dim too; bytes as they are
        elif t.dtype.hasobject:  # its bytes are pointers, another on each rank: not the batch's identity
            continue
        else:
            data = np.ascontiguousarray(t).reshape(-1).view(np.uint8)
        crc, seen = zlib.crc32(data, crc), True  # read where it lies: no copy of the batch
    return crc if seen else None


class Batches(IterableDataset):
    """A generator (or any iterator) of batches as a stream, read once: what ``parallelize(model, gen)`` splits."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        return self.source


class StreamShard(DataLoader):
    """The DataLoader ``parallelize`` returns for a DataLoader over an ``IterableDataset``: the original's batches,
    this rank's rows of each (see the module docstring). Under ``autodist run --elastic`` the ranks left after a
    lost one read the stream again from the epoch's start to the last applied step (:mod:`autodist.dp.elastic_data`),
    each batch checked against the one read before: a stream that gives other batches when read again cannot be
    split again, and says so."""

    watch_key = "stream"
    cut: Callable[[Any], Any] | None = None  # each batch's last change before the loop takes it (context parallel)

    def __init__(self, source: DataLoader, rank: int, size: int, dim: int, key: str) -> None:
        super().__init__(source.dataset, batch_size=None)  # never iterated itself: ``source`` is
        self.source, self.rank, self.size, self.dim, self.watch_key = source, rank, size, dim, key
        self.position = Position([source.generator])
        self.resuming: Resuming | None = None  # what the next _fresh() passes over
        self.latest_shares: deque[BatchShare] = deque()
        self.marks: list[int | None] = []  # elastic: the epoch's batches so far, to check a reading again

    def __iter__(self) -> Iterator[Any]:
        try:
            steps = len(self.source)
        except TypeError:  # a stream without len(): nothing to compare
            steps = -1
        if elastic.current() is not None:  # the ranks left after a lost one take the abandoned batches again
            self.marks = []
            return elastic_data.epoch(self, self, self._fresh, steps, -1)
        self.resuming = self.position.begin()
        epoch = self.position.epoch
        watchdog.epoch_begins(self.watch_key, epoch, steps, -1)
        batches = self._fresh()
        return handed_over(batches, self.latest_shares, (self.watch_key, epoch, steps, -1), self.position, self.cut)

    def _fresh(self) -> Iterator[Any]:
        """The stream from the epoch's start as ``rank``, ``size`` and ``resuming`` are set now."""
        self.latest_shares = deque()
        resuming, self.resuming = self.resuming, None
        return self._slices(self.latest_shares, resuming)

    def _slices(self, shares: deque[BatchShare], resuming: Resuming | None) -> Iterator[Any]:
        batches = iter(self.source)
        keeping = elastic.current() is not None
        if resuming is not None:  # a stream has no index: its first batches are read again, and dropped
            if self.rank == 0:
                from autodist.runtime.world import log

                log.info("resuming a stream in its epoch %d: reading and dropping the %d batches taken before%s",
                         self.position.epoch, resuming.skip, " the last applied step" if keeping else
                         " the checkpoint")
            if keeping:
                batches = self._same_again(batches, self.marks[:resuming.skip])
                del self.marks[resuming.skip:]
            pass_over(batches, resuming, lambda batch, number: mark(batch))
        for batch in batches:
            if self.size == 1:  # one process: the batch as the loader made it, counted for the position
                shares.append(BatchShare(1, 1, provenance.new_batch_id(), mark(batch), None))  # for a resume
                if keeping:
                    self.marks.append(shares[-1].mark)
                yield batch
                continue
            n = batch_size(batch, self.dim)
            lo, hi = slice_bounds(n, self.rank, self.size)
            whole = (lambda kept=batch: kept) if provenance.keeping() else None
            shares.append(BatchShare(hi - lo, n, provenance.new_batch_id(), mark(batch), whole))
            if keeping:
                self.marks.append(shares[-1].mark)
            yield rows(batch, lo, hi, self.dim, n) if hi > lo else rows(batch, 0, 1, self.dim, n)  # a stand-in

    def _same_again(self, batches: Iterator[Any], marks: list[int | None]) -> Iterator[Any]:
        """``batches``, the first of them checked against the ``marks`` of the batches read before."""
        for number, batch in enumerate(batches):
            if number < len(marks) and mark(batch) != marks[number]:
                raise RuntimeError(
                    f"the stream gave another batch {number + 1} of epoch {self.position.epoch} when read again "
                    f"after a lost rank: the ranks left read it again from the epoch's start to split the "
                    f"batches since the last applied step over themselves, so it must give the same batches each "
                    f"time it is iterated (seed its shuffle; an iterator that can be read once cannot be split "
                    f"again). Run without --elastic to restart from a checkpoint instead")
            yield batch

    def __len__(self) -> int:
        return len(self.source)  # the single-process loader's global batches (raises where it has no len())
