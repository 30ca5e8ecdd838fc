"""Where a tensor came from: the batches and shards that autodist's data pipeline handed out.

A sharded DataLoader knows, for every batch it yields, this rank's number of
samples n_r and the global batch's N; a sharded tensor knows which memory holds
its samples, one row each. This module remembers both, so that a forward pass
can be matched with the data it was given without looking at the layout of
its arguments:

* every tensor of a yielded batch is registered by the memory it occupies,
  so the batch tensor itself and any view of it (a slice ``x[:, :-1]``, a
  transpose to seq-first) are recognised;
* every sharded tensor is registered the same way with its row stride, so a
  slice ``shard[i:i+b]`` (or its transpose) counts the rows it covers (for a
  tensor split along a later dimension, (time, batch) data, the columns a time
  window ``shard[i:i+seq]`` covers);
* the batch a sharded DataLoader handed to this thread last is the *current*
  one, for a forward whose inputs were copied (``x.to("cuda")``).

Registrations go away with their tensors; nothing here keeps data alive.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from autodist.runtime.tree import tensor_leaves


@dataclass(frozen=True)
class BatchShare:
    """This rank's part of one global batch: ``count`` of ``total`` samples.

    Example:
        >>> BatchShare(count=3, total=8, batch=new_batch_id(), mark=0x5eed)   # 3 of 8 samples here
    """

    count: int
    total: int
    batch: int  # which global batch: two forwards on the same batch count once
    mark: int | None = None  # its identity, the same on every rank (which samples, in order): ranks compare it
    whole: Callable[[], Any] | None = field(default=None, compare=False, repr=False)  # the one-process batch
    # (collated again from its samples, or the stream's batch), where batches are kept: keep_batches()


@dataclass(frozen=True)
class _Region:
    device: torch.device
    start: int  # first byte
    end: int  # one past the last byte
    row_bytes: int  # a shard's sample stride; 0 for a loader batch
    share: BatchShare | None  # a loader batch's share; None for a shard
    across: tuple[int, ...] = ()  # a shard split along a later dimension: the other dimensions' strides (bytes)


_regions: dict[int, _Region] = {}
_batch_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity too: an empty tensor has no memory
_lock = threading.Lock()
_batch_ids = itertools.count()
_local = threading.local()


def _span(t: torch.Tensor | np.ndarray) -> tuple[torch.device, int, int]:
    if isinstance(t, np.ndarray):
        start = t.__array_interface__["data"][0]
        return torch.device("cpu"), start, start + t.nbytes
    start = t.data_ptr()
    size = t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0))
    return t.device, start, start + (size if t.numel() else 0)


def _register(obj: torch.Tensor | np.ndarray, row_bytes: int, share: BatchShare | None,
              across: tuple[int, ...] = ()) -> None:
    device, start, end = _span(obj)
    if end <= start:
        return
    key = next(_batch_ids)
    with _lock:
        _regions[key] = _Region(device, start, end, row_bytes, share, across)
    weakref.finalize(obj, _forget, key)


def _forget(key: int) -> None:
    with _lock:
        _regions.pop(key, None)


def new_batch_id() -> int:
    return next(_batch_ids)


def register_batch(batch: Any, share: BatchShare) -> None:
    """Remember that the tensors of ``batch`` (nested anyhow) hold ``share``'s samples."""
    for _, t in tensor_leaves(batch):
        _batch_tensors[t] = share
        if not t.numel() and t._base is not None:  # views of an empty batch (x.t()) have its root as their base
            _batch_tensors[t._base] = share
        if t.layout == torch.strided and t.numel() and not _lookup(t):
            _register(t, 0, share)


def register_shard(shard: torch.Tensor | np.ndarray, dim: int = 0) -> None:
    """Remember a sharded tensor or array: its entries along ``dim`` (its rows, or the columns of (time,
    batch) data) are this rank's samples."""
    if shard.ndim > dim and shard.shape[dim] > 0:
        strides = shard.strides if isinstance(shard, np.ndarray) else \
            tuple(s * shard.element_size() for s in shard.stride())
        _register(shard, strides[dim], None, tuple(s for d, s in enumerate(strides) if d != dim) if dim else ())


def _lookup(t: torch.Tensor) -> _Region | None:
    device, start, end = _span(t)
    if end <= start:
        return None
    with _lock:
        for region in _regions.values():
            if region.device == device and region.start <= start and end <= region.end:
                return region
    return None


def _rows(t: torch.Tensor, row_bytes: int) -> int | None:
    """How many rows of a shard with sample stride ``row_bytes`` the view ``t`` covers; None if not a clean
    selection of whole rows' parts (then the count is not known from the shard)."""
    rows, within = 1, 0
    for size, stride in zip(t.shape, t.stride()):
        step = stride * t.element_size()
        if size > 1 and step >= row_bytes and step % row_bytes == 0:
            rows *= size
        elif size > 1:
            within += (size - 1) * step
    return rows if within < row_bytes else None


def _across(t: torch.Tensor, region: _Region) -> int | None:
    """How many samples of a shard split along a later dimension the view ``t`` covers: the entries along its
    dimension that steps from sample to sample (by the sample stride, or a multiple: every k-th sample); None
    if ``t`` is not such a slice (a flattened view, say)."""
    if t.ndim != len(region.across) + 1:
        return None
    samples = 1
    for size, stride in zip(t.shape, t.stride()):
        step = stride * t.element_size()
        if size <= 1 or step in region.across:
            continue
        if step % region.row_bytes:
            return None
        samples *= size
    return samples


def known_share(t: torch.Tensor) -> BatchShare | int | None:
    """What the data pipeline knows of ``t``: a loader batch's share, the rows of a shard it covers, or None."""
    for candidate in (t, t._base):
        if candidate is not None and candidate in _batch_tensors:
            return _batch_tensors[candidate]
    if t.layout != torch.strided or not t.numel():
        return None
    region = _lookup(t)
    if region is None:
        return None
    if region.share is not None:
        return region.share
    return _across(t, region) if region.across else _rows(t, region.row_bytes)


_keeping = [0]  # how many users want the batches themselves kept (autodist's check of a step)


def announce(share: BatchShare | None, batch: Any = None) -> None:
    """The batch this thread's loop was just handed (None: the epoch ended); the batch itself is kept only
    while something asked for it (:func:`keep_batches`)."""
    _local.current = share
    _local.batch = batch if _keeping[0] else None


def current() -> BatchShare | None:
    """The batch a sharded DataLoader last handed to this thread, if its epoch is still going."""
    return getattr(_local, "current", None)


def keep_batches(on: bool) -> None:
    """Keep (or stop keeping) the batch last handed out (:func:`current_batch`), and give each share a way to
    the whole global batch (``BatchShare.whole``)."""
    _keeping[0] += 1 if on else -1


def keeping() -> bool:
    return _keeping[0] > 0


def current_batch() -> Any:
    """The batch the sharded DataLoader last handed to this thread, where batches are kept; else None."""
    return getattr(_local, "batch", None)
