"""The bytes of tensors made while a piece of code runs, and their peak: each new storage an op returns is
counted until it is freed. What the planner measures activations and a step's transient memory with, on any
device (CUDA's allocator statistics exist only there).

Example:
    >>> with LiveBytes() as live:
    ...     model(x).sum().backward()
    >>> live.peak                     # most bytes made inside the block and alive at one time
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts the storages ops create inside the block (views and in-place results add nothing) until each is
    freed; ``now`` is what is alive, ``peak`` the most at one time. :meth:`hold` adds bytes that are not
    there (gradients dropped as they arrive, counted as if kept): ``peak_held`` is the most with them."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = self.held = self.peak_held = 0
        self._alive: dict[int, int] = {}  # storage address -> bytes
        self._refs: list[weakref.ref] = []

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.now + self.held)

    def _free(self, ptr: int, ref: weakref.ref) -> None:
        self.now -= self._alive.pop(ptr, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs))}  # a view or an in-place result makes nothing
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if not size or ptr in self._alive or ptr in inputs:
                continue
            self._alive[ptr] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            self.peak_held = max(self.peak_held, self.now + self.held)
            self._refs.append(weakref.ref(storage, lambda ref, ptr=ptr: self._free(ptr, ref)))
        return out


def nbytes(tensors: Any) -> float:
    """The bytes of ``tensors`` (any iterable of them)."""
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _ptr(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and not t.is_meta else None
