"""Every tensor byte alive in this process, found through the garbage collector: how much
memory a rank holds, counted the same way for autodist and for torch's peers. Not a benchmark itself.

Each storage is counted once, however many tensors view it (a view of a parameter, a gradient that is a
view of a bucket). Pages of a shared mapping that every rank of the host maps (autodist's file of shared
memory) are counted 1/``sharers`` on each rank, as the host holds them once. A DTensor counts its local part;
a tensor subclass without storage of its own (autodist's ``ShardedGrad``) counts the tensor it wraps.
The gradients of parameters are found through their parameters (torch need not have made Python objects
of them). Independent of autodist's own bookkeeping (``autodist.memory``), which the tests check against it.

The process's resident memory and its peak (:func:`resident`, :func:`reset_peak`), the operating system's view of
the same, with the interpreter, the libraries and the allocator's free pages in it, are here too.

Example:
    >>> live_tensor_bytes(sharers=2)    # on a rank of two on one host
    134_742_016.0
    >>> reset_peak(); train_a_few_steps(); resident("VmHWM")   # the peak resident memory in those steps
    412_880_896
"""
from __future__ import annotations

import ctypes
import gc
import mmap
import warnings
from typing import Any

import torch


def _mappings() -> list[tuple[int, int]]:
    """The address ranges of the mmap objects alive in this process."""
    spans = []
    for obj in gc.get_objects():
        if isinstance(obj, mmap.mmap) and not obj.closed:
            try:
                start = ctypes.addressof(ctypes.c_char.from_buffer(obj))
            except (TypeError, ValueError, BufferError):
                continue
            spans.append((start, start + len(obj)))
    return spans


def _storages(roots: list[Any]) -> dict[int, int]:
    """{first byte: bytes} of every storage behind the tensors among ``roots``."""
    found: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        inner = getattr(t, "_local_tensor", None)  # a DTensor: its local part
        if torch.is_tensor(inner):
            return add(inner)
        if t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass: what it wraps
            local = getattr(t, "local", None)
            if torch.is_tensor(local):
                add(local)
            return
        if size:
            found[start] = max(found.get(start, 0), size)

    for obj in roots:
        try:
            if not torch.is_tensor(obj):
                continue
            add(obj)
            if obj.is_leaf and obj.grad is not None:
                add(obj.grad)
        except (RuntimeError, ReferenceError):
            continue
    return found


def live_storages() -> dict[int, int]:
    """{first byte: bytes} of every tensor storage alive in this process, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        return _storages(gc.get_objects())


def live_tensor_bytes(sharers: int = 1) -> float:
    """Bytes of every tensor storage alive in this process (see the module docstring); bytes
    inside a shared mapping count 1/``sharers``."""
    spans = sorted((start, start + size) for start, size in live_storages().items())
    with warnings.catch_warnings():  # as in live_storages: every object is looked at
        warnings.simplefilter("ignore")
        mappings = _mappings()
    merged: list[list[int]] = []
    for start, end in spans:  # storages that overlap (views of one mapping) count once
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = 0.0
    for start, end in merged:
        shared = sum(max(0, min(end, b) - max(start, a)) for a, b in mappings)
        total += (end - start - shared) + shared / sharers
    return total


def resident(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak since the last :func:`reset_peak` (``VmHWM``), in
    bytes (Linux's /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """Start the peak resident memory (``VmHWM``) again from what the process holds now."""
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak
        f.write("5")
