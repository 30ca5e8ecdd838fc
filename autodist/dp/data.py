"""Sharding of the user's data by data-parallel rank.

Two rules make a parallel run see the same global batches as one process:

* tensors, arrays and Datasets are split *strided* (rank r keeps samples
  r, r+P, r+2P, ...), so batch i of size b on every rank together is exactly
  the single-process batch i of size P*b, in order; a tensor's samples run
  along ``batch_dim`` (columns of (time, batch) language-model data);
* a DataLoader keeps its own sampler: every rank draws the same global batch
  and keeps its contiguous slice of it, so the epoch's batches, their order and
  the per-epoch reshuffling are the single-process loader's (a sampler on the
  global RNG is drawn on every rank and rank 0's order broadcast, once an epoch).
"""
from __future__ import annotations

import collections.abc
import copy
import itertools
import zlib
from collections import deque
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from autodist.dp import elastic_data
from autodist.dp.handover import handed_over, slice_bounds
from autodist.dp.loader_position import Position, Resuming, pass_over
from autodist.dp.resplit import RankShard, refuse_split_again
from autodist.dp.stream import Batches, StreamShard, rows
from autodist.faults import elastic, watchdog
from autodist.runtime import position, provenance
from autodist.runtime.provenance import BatchShare

DataLike = Any  # tensor | np.ndarray | tuple/list of them | Dataset | DataLoader


def _length(x: Any, where: str, dim: int = 0) -> int:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim == 0:
            raise ValueError(f"{where} is a 0-dimensional {type(x).__name__}; data needs a first (sample) dimension")
        if x.ndim <= dim:
            raise ValueError(f"{where} has shape {tuple(x.shape)} but batch_dim={dim} says its samples run along "
                             f"dimension {dim}; pass the batch_dim of the data (0 for (batch, ...) data, 1 for "
                             f"(time, batch) language-model data)")
        return x.shape[dim]
    raise TypeError(f"{where} is a {type(x).__name__}; autodist shards torch.Tensor and numpy.ndarray "
                    f"(or a Dataset / DataLoader)")


def _check_enough(n: int, size: int, what: str) -> None:
    if n < size:
        raise ValueError(f"{what} holds {n} sample(s) but there are {size} data-parallel ranks: every rank "
                         f"needs at least one sample; use fewer ranks or more data")


def _warn_uneven(n: int, rank: int, size: int, what: str) -> None:
    """Uneven strided shards are exact, but a loop over them may take a different number of steps per rank."""
    if n % size and rank == 0:
        from autodist.runtime.world import log

        log.warning("%s holds %d samples, which do not split evenly over %d ranks: shards hold %d or %d. "
                    "Every rank must take the same number of steps (each step's backward communicates), so "
                    "batch the shards such that ceil(shard / batch) is the same on every rank, drop the last "
                    "partial batch, or pass a DataLoader, which autodist splits per global batch",
                    what, n, size, n // size + 1, n // size)


def _strided(x: torch.Tensor | np.ndarray, rank: int, size: int, dim: int = 0) -> torch.Tensor | np.ndarray:
    part = x[(slice(None),) * dim + (slice(rank, None, size),)]
    shard = np.ascontiguousarray(part) if isinstance(x, np.ndarray) else part.contiguous()
    provenance.register_shard(shard, dim)  # a slice of it then counts the samples it covers
    return shard


def shard_arrays(data: Any, rank: int, size: int, dim: int = 0) -> Any:
    """Rank's strided shard of a tensor / array, or of a tuple or list of them sharing their sample dimension
    ``dim`` (1 for (time, batch) data: rank r keeps columns r, r+P, ...)."""
    if isinstance(data, (tuple, list)):
        if not data:
            raise ValueError("data is an empty tuple/list; pass the tensors or arrays to shard")
        lengths = [_length(x, f"data[{i}]", dim) for i, x in enumerate(data)]
        if len(set(lengths)) > 1:
            raise ValueError(f"the tensors/arrays in data have different lengths {lengths} along dimension {dim}; "
                             f"they must share their sample dimension (batch_dim={dim})")
        _check_enough(lengths[0], size, "data")
        _warn_uneven(lengths[0], rank, size, "data")
        return type(data)(_strided(x, rank, size, dim) for x in data)
    _check_enough(_length(data, "data", dim), size, "data")
    _warn_uneven(_length(data, "data", dim), rank, size, "data")
    return _strided(data, rank, size, dim)


def shard_dataset(dataset: Dataset, rank: int, size: int) -> RankShard:
    """Rank's strided view of a map-style Dataset (samples rank, rank+size, ...), which refuses a second split."""
    if isinstance(dataset, IterableDataset):
        raise TypeError("an IterableDataset has no samples to split by index: pass it in the DataLoader you "
                        "train from (DataLoader(stream, batch_size=...)), whose batches autodist splits by rank")
    n = len(dataset)  # type: ignore[arg-type]
    _check_enough(n, size, "the Dataset")
    _warn_uneven(n, rank, size, "the Dataset")
    return RankShard(dataset, range(rank, n, size))


def _hugging_face_dataset(data: Any) -> bool:
    """Whether ``data`` is a Hugging Face ``datasets.Dataset`` (map-style: not a torch Dataset, but indexable)."""
    return (type(data).__module__.startswith("datasets.") and not isinstance(data, Dataset)
            and callable(getattr(data, "shard", None)) and hasattr(data, "__len__"))


def shard_hugging_face(dataset: Any, rank: int, size: int) -> Any:
    """Rank's strided part of a Hugging Face ``datasets.Dataset``, by its own ``shard(contiguous=False)`` (samples
    rank, rank+size, ...: the rule of :func:`shard_dataset`), so it stays a ``datasets.Dataset``."""
    n = len(dataset)
    _check_enough(n, size, "the Dataset")
    _warn_uneven(n, rank, size, "the Dataset")
    return dataset.shard(num_shards=size, index=rank, contiguous=False)


class RankSliceBatchSampler(Sampler[list]):
    """Yields this rank's contiguous slice of each global batch of ``batch_sampler``.

    All ranks iterate the same global batch sampler, so they agree on every
    batch. Where a global batch is smaller than the ranks, a rank that holds
    none of it gets its first sample as a stand-in, with a count of 0: the
    model never runs on an empty batch, and that rank's gradient is zero
    (:meth:`autodist.dp.grad_sync.GradSync._reached`).
    Each iteration records, in order, the share (slice length, global batch
    length) of every slice it yields, for :class:`ShardedLoader` to hand over
    with the batch.
    """

    def __init__(self, batch_sampler: Sampler[list] | Sequence[list], rank: int, size: int) -> None:
        self.batch_sampler, self.rank, self.size = batch_sampler, rank, size
        self.latest_shares: deque[BatchShare] = deque()
        self.whole: Callable[[list], Any] | None = None  # collates a global batch as one process (shard_loader)
        self.resuming: Resuming | None = None  # set by the loader for the epoch it resumes

    def __iter__(self) -> Iterator[list]:
        refuse_split_again("the DataLoader")
        self.latest_shares = deque()  # the DataLoader iterator created now reads this one
        resuming, self.resuming = self.resuming, None
        return self._slices(self.latest_shares, resuming)

    def _slices(self, shares: deque[BatchShare], resuming: Resuming | None) -> Iterator[list]:
        batches = iter(self.batch_sampler)
        if resuming is not None and resuming.drawn and resuming.skip == 0:  # the sampler draws at its first batch:
            batches = itertools.chain([next(batches)], batches)  # now, on the epoch's generators, as it did
        start = 0
        if resuming is not None:  # indices only: no sample is loaded
            start = pass_over(batches, resuming, lambda indices, number: _mark(list(indices), number))
        for number, batch in enumerate(batches, start):
            batch = list(batch)
            lo, hi = slice_bounds(len(batch), self.rank, self.size)
            whole = partial(self.whole, batch) if self.whole is not None and provenance.keeping() else None
            shares.append(BatchShare(hi - lo, len(batch), provenance.new_batch_id(), _mark(batch, number), whole))
            yield batch[lo:hi] if hi > lo else batch[:1]  # no row here: the batch's first stands in, weighted 0

    def __len__(self) -> int:
        refuse_split_again("the DataLoader")
        return len(self.batch_sampler)  # type: ignore[arg-type]


def _mark(batch: list, number: int) -> int:
    """The identity of a global batch, the same on every rank that draws it: a CRC-32 of its sample indices in
    order (of its number in the epoch where the indices are not integers, whose text may differ between
    processes)."""
    if all(type(i) is int for i in batch):  # noqa: E721 - bool and numpy integers take the other path
        return zlib.crc32(np.asarray(batch, dtype=np.int64).tobytes())
    return zlib.crc32(number.to_bytes(8, "little"))


class ShardedLoader(DataLoader):
    """The DataLoader ``parallelize`` returns: the original loader's batches, this rank's slice of each.

    Handing a batch to the loop also tells autodist which global batch it is
    part of (this rank's count n_r and the batch's N): a backward through a
    forward on that batch is weighted n_r / N, whatever the forward's inputs
    look like.
    """

    watch_key = "loader"  # names this loader in the watchdog's store: the same on every rank (creation order)
    position: Position  # where the loop stands in the epochs, for checkpoints (set by shard_loader)
    cut: Callable[[Any], Any] | None = None  # each batch's last change before the loop takes it (context parallel)

    def __iter__(self) -> Iterator[Any]:
        try:
            steps = len(self.batch_sampler)  # type: ignore[arg-type]
        except TypeError:  # a batch sampler without len(): nothing to compare
            steps = -1
        samples = len(self.dataset)  # type: ignore[arg-type]
        if elastic.current() is not None:  # the ranks left after a lost one take the abandoned batches again
            return elastic_data.epoch(self, self.batch_sampler, super().__iter__, steps, samples)
        resuming = self.position.begin(samples)
        self.batch_sampler.resuming = resuming  # type: ignore[union-attr]
        batches = super().__iter__()
        epoch = self.position.epoch
        watchdog.epoch_begins(self.watch_key, epoch, steps, samples)
        return handed_over(batches, self.batch_sampler.latest_shares,  # type: ignore[union-attr]
                           (self.watch_key, epoch, steps, samples), self.position, self.cut)


class EmptySafeCollate:
    """The user's collate_fn, plus a well-formed zero-sample batch for an empty slice.

    An empty batch keeps every rank stepping in lock-step (no hang) when the
    last global batch is smaller than the number of ranks; autodist weights
    that rank's gradient by its zero samples.
    """

    def __init__(self, collate_fn: Callable[[list], Any], dataset: Dataset, dim: int = 0) -> None:
        self.collate_fn, self.dataset, self.dim = collate_fn, dataset, dim

    def __call__(self, samples: list) -> Any:
        if len(samples) == 0:  # a batch of one, cut to none of its rows (along batch_dim)
            return rows(self.collate_fn([self.dataset[0]]), 0, 0, self.dim)
        return self.collate_fn(samples)


_loader_numbers = itertools.count()  # every rank shards its loaders in the same order

_KEPT_LOADER_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                        "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


ShareOrder = Callable[[Iterable[int]], list[int]]  # an epoch's sample order, as rank 0 drew it


def broadcast_order(order: Iterable[int], device: torch.device) -> list[int]:
    """Every rank draws ``order`` (iterating it) and returns rank 0's list. Every rank must call it.

    Every rank draws, not only rank 0, so that all global RNGs move alike:
    ranks that share an RNG stream (a model-parallel group, for dropout) keep
    sharing it. Rank 0's draw is the single-process run's.
    """
    drawn = torch.tensor(list(order), dtype=torch.int64, device=device)
    length = torch.tensor([drawn.numel()], dtype=torch.int64, device=device)
    with position.waiting("order"):
        dist.broadcast(length, src=0)
        if dist.get_rank() != 0:
            drawn = torch.empty(int(length.item()), dtype=torch.int64, device=device)
        dist.broadcast(drawn, src=0)
    return drawn.tolist()


class Rank0Order(Sampler[int]):
    """A sampler that draws from the global RNG, made to agree across ranks: each epoch, every rank iterates
    it and all take rank 0's order.

    RandomSampler without a generator, SubsetRandomSampler and
    WeightedRandomSampler take their randomness from the global RNG, which
    differs between ranks. Rank 0 draws just as the single-process loader
    would (same calls on the same RNG), so with the same ``torch.manual_seed``
    the parallel run sees the single-process batches. The first batch of an
    epoch is then a collective: every rank must fetch it, in the same order
    relative to its other collectives (the usual training loop does).
    """

    def __init__(self, sampler: Sampler[int], share: ShareOrder) -> None:
        self.sampler, self.share = sampler, share

    def __iter__(self) -> Iterator[int]:
        return iter(self.share(self.sampler))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


def _agreeing(batch_sampler: Any, share: ShareOrder) -> Any:
    """``batch_sampler`` with a global-RNG sampler wrapped in :class:`Rank0Order` (on a copy: the user's loader
    is left as it was)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(batch_sampler, BatchSampler) and hasattr(sampler, "generator") and sampler.generator is None:
        batch_sampler = copy.copy(batch_sampler)
        batch_sampler.sampler = Rank0Order(sampler, share)
    return batch_sampler


def _stream(loader: DataLoader, rank: int, size: int, dim: int) -> StreamShard:
    """Rank's rows of each batch of a loader over a stream (:mod:`autodist.dp.stream`), named for the watchdog
    in creation order, as the map-style loaders are."""
    return StreamShard(loader, rank, size, dim, f"{next(_loader_numbers)}.stream")


def shard_loader(loader: DataLoader, rank: int, size: int, share: ShareOrder, dim: int = 0) -> DataLoader:
    """A DataLoader yielding rank's slice of each of ``loader``'s global batches.

    ``share`` is called (on every rank together, once an epoch) only when the
    loader's sampler draws from the global RNG: it hands every rank rank 0's order.
    Over an ``IterableDataset`` every rank reads the stream and keeps rows of each
    batch along ``dim`` (:mod:`autodist.dp.stream`).
    """
    if isinstance(loader.dataset, IterableDataset):
        return _stream(loader, rank, size, dim)
    if loader.batch_sampler is None:
        raise ValueError("the DataLoader was built with batch_size=None (no batching), so there is no global "
                         "batch to split; give it a batch_size or a batch_sampler")
    sampler = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        raise ValueError("the DataLoader already uses a DistributedSampler; pass the plain single-process "
                         "DataLoader and autodist shards it")
    _check_enough(len(loader.dataset), size, "the DataLoader's dataset")  # type: ignore[arg-type]
    options = {name: getattr(loader, name) for name in _KEPT_LOADER_OPTIONS if hasattr(loader, name)}
    if options.get("in_order") is False:
        raise ValueError("the DataLoader was built with in_order=False: autodist matches each batch with its "
                         "share of the global batch by order, so pass a loader with in_order=True (the default)")
    batches = RankSliceBatchSampler(_agreeing(loader.batch_sampler, share), rank, size)
    batches.whole = partial(_collated, loader.dataset, loader.collate_fn)
    sharded = ShardedLoader(loader.dataset, batch_sampler=batches,
                            collate_fn=EmptySafeCollate(loader.collate_fn, loader.dataset, dim), **options)
    sharded.watch_key = f"{next(_loader_numbers)}.{getattr(loader, 'batch_size', None)}"
    sharded.order = share if isinstance(share, elastic_data.ElasticOrder) else None
    sharded.position = Position([loader.generator, getattr(sampler, "generator", None)])
    # what DDP code reaches for (loader.sampler.set_epoch(epoch)); the batches come from batch_sampler
    object.__setattr__(sharded, "sampler", EpochSampler(loader.dataset, getattr(loader.batch_sampler, "sampler",
                                                                               None)))
    return sharded


def _collated(dataset: Any, collate_fn: Callable[[list], Any], indices: list) -> Any:
    """A global batch as the single-process loader collates it (autodist's check of a step: docs)."""
    return collate_fn([dataset[i] for i in indices])


class EpochSampler(SequentialSampler):
    """``loader.sampler`` of the DataLoader ``parallelize`` returns. Its batches come from the batch sampler
    (your loader's own sampler, sliced per rank), so this one only answers what DDP code asks of a
    ``DistributedSampler``: ``set_epoch(epoch)`` passes the epoch on to your sampler if it takes one, and is
    otherwise accepted as it is: the loader already reshuffles every epoch as your single-process loader does
    (rank 0's draw, shared), which a DistributedSampler needs ``set_epoch`` for.

    Example:
        >>> for epoch in range(epochs):
        ...     loader.sampler.set_epoch(epoch)   # as in a DDP script: harmless
    """

    def __init__(self, dataset: Any, inner: Any) -> None:
        super().__init__(dataset)
        self.inner = inner

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)


def shard(data: DataLike, rank: int, size: int, share: ShareOrder = list, dim: int = 0) -> DataLike:
    """Rank's shard of ``data``, of the same kind as ``data``.

    Args:
        data: a tensor or numpy array, a tuple/list of them, a map-style Dataset (a Hugging Face
            ``datasets.Dataset`` too), a DataLoader (over a map-style Dataset or a stream) or a generator of
            batches.
        rank / size: this rank's data-parallel index, and the number of data-parallel ranks.
        share: for a DataLoader whose sampler draws from the global RNG, gives every
            rank rank 0's order of an epoch (:func:`broadcast_order`); the default,
            ``list``, is right in a single process only.
        dim: the dimension of tensors and arrays that indexes samples (``batch_dim``); a Dataset and a
            DataLoader index samples themselves.

    Example:
        >>> shard(torch.arange(5), rank=1, size=2)
        tensor([1, 3])
    """
    if isinstance(data, DataLoader):
        return shard_loader(data, rank, size, share, dim)
    if _hugging_face_dataset(data):
        return shard_hugging_face(data, rank, size)
    if isinstance(data, Dataset):
        return shard_dataset(data, rank, size)
    if isinstance(data, (torch.Tensor, np.ndarray, tuple, list)):
        return shard_arrays(data, rank, size, dim)
    if isinstance(data, collections.abc.Iterator):  # a generator of batches: a stream whose items are batches
        return _stream(DataLoader(Batches(data), batch_size=None), rank, size, dim)
    raise TypeError(f"autodist cannot shard data of type {type(data).__name__}; pass a tensor, a numpy array, "
                    f"a tuple/list of them, a torch Dataset, a DataLoader or a generator of batches")


def check(data: DataLike, size: int, dim: int = 0) -> None:
    """Validate ``data`` without sharding it (a world of one returns data as it is)."""
    if data is not None:
        shard(data, 0, size, dim=dim)


def in_one_process(data: DataLike, dim: int = 0) -> DataLike:
    """``data`` in a world of one: validated, and returned as it is except for a DataLoader, which comes back as
    the one ``parallelize`` returns on more ranks (at one rank: the same batches, in the same order) so that it
    keeps its position for ``autodist.save``: the script resumes mid-epoch in one process as it does on more,
    from a checkpoint of any number of ranks. Its ``batch_size`` and ``drop_last`` read as the loader's, and
    ``loader.sampler.set_epoch(epoch)`` (DDP's habit) is accepted.

    Example:
        >>> loader = in_one_process(DataLoader(range(4), batch_size=2, shuffle=True))
        >>> loader.sampler.set_epoch(1)
        >>> loader.batch_size
        2
    """
    if not isinstance(data, DataLoader):
        check(data, 1, dim)
        return data
    kept = shard_loader(data, 0, 1, list, dim)
    for name in ("batch_size", "drop_last"):  # what a one-process script may read of its loader
        object.__setattr__(kept, name, getattr(data, name))
    if not hasattr(kept.sampler, "set_epoch"):  # a stream's: nothing to pass an epoch to
        object.__setattr__(kept, "sampler", EpochSampler(data.dataset, None))
    return kept
