"""``autodist.memory(model, optimizer)``: the bytes this rank holds for a model, by kind.

Every tensor the model and its optimizer hold, and every one autodist keeps for them (buckets, the slices
of sharded state, the shards of the parameters, a strategy's copies, files of shared memory, the whole batch
a context-parallel model's ranks cut theirs from), each storage
counted once, under the first kind that claims it (:data:`autodist.runtime.held.KINDS`): a gradient that is
a view of a gradient bucket is a gradient. A file of shared memory that the ``k`` ranks of a host map costs
each of them ``1/k`` of it (the host holds it once): what of this rank's share its gradients are views of
counts as gradients, the rest as "shared memory". Tensors of any dtype count, on any device.

What it does not count: what the script itself holds (batches, activations kept alive, a copy of the
weights), and memory that is not a tensor (the interpreter, torch, the process group's own buffers). So
right after a step, in a script that keeps nothing else, the total is every tensor byte the rank holds.

Example:
    >>> held = autodist.memory(model, optimizer)
    >>> held["optimizer state"] / 2**20               # MiB of Adam's moments on this rank
    >>> print(held)                                    # a table, by kind, with the total
"""
from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

from autodist.cp.forward import context_of
from autodist.dp.grad_sync import registration_of
from autodist.layers.shared_reduce import reducer_of
from autodist.mp.rewrite import mp_modules
from autodist.runtime.compiled import unwrapped
from autodist.runtime.held import KINDS, Held
from autodist.runtime.tree import tensor_leaves
from autodist.runtime.world import init
from autodist.sharded import optimizer as sharded_optimizer
from autodist.sharded import parameters as sharded_parameters
from autodist.sync import strategy_of

Span = tuple[int, int]  # [first byte, one past the last)


class Memory(dict):
    """Bytes by kind (the keys of :data:`~autodist.runtime.held.KINDS`, in that order); ``print`` shows a
    table. ``total`` is their sum; ``files`` the files of shared memory counted, as (bytes, ranks mapping)."""

    def __init__(self, counted: dict[str, float], files: list[tuple[int, int]], rank: int, size: int) -> None:
        super().__init__(counted)
        self.files, self.rank, self.size = files, rank, size

    @property
    def total(self) -> float:
        return sum(self.values())

    def __str__(self) -> str:
        width = max(len(k) for k in self)
        rows = [f"  {kind:<{width}}  {value / 1e6:10.1f} MB" for kind, value in self.items()]
        files = ", ".join(f"{n / 1e6:.1f} MB / {k} ranks" for n, k in self.files)
        if files:
            rows[-1] += f"  (its part of the files the ranks of this host map: {files}; less its gradients there)"
        return "\n".join([f"memory of rank {self.rank} of {self.size}:", *rows,
                          f"  {'total':<{width}}  {self.total / 1e6:10.1f} MB"])


def memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Memory:
    """The bytes this rank holds for ``model`` (and ``optimizer``), by kind.

    Args:
        model: a model, parallelized or not (a world of one counts the same way).
        optimizer: its optimizer, whose state counts as "optimizer state" (under ``shard=`` the slices this
            rank keeps count whether or not it is given).

    Returns:
        A dict of bytes: "parameters", "model buffers", "gradients", "optimizer state", "autodist buffers"
        (buckets, snapshots, messages under way) and "shared memory" (this rank's share of the files of
        shared memory autodist made for the model, less its gradients there); ``.total``; ``print`` gives a
        table.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, shard="gradients")
        >>> ...                                               # a step
        >>> print(autodist.memory(model, optimizer))          # on every rank: its own bytes

    Note:
        Call it between steps: during one, the blocks in use and the activations come and go. Nothing is
        communicated: each rank reports its own.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found: autodist.memory takes the model "
                        f"(and optionally its optimizer)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Expect a torch.optim.Optimizer for optimizer, {type(optimizer).__name__} found")
    world = init()
    return _count(_held(model, optimizer), world.rank, world.size)


def _held(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Held:
    held = Held()
    inner = unwrapped(model)  # torch.compile's wrapper: the model it compiled
    params = list(inner.parameters())
    held.add("parameters", *params)
    held.add("model buffers", *inner.buffers())
    held.add("gradients", *(p.grad for p in params))
    if optimizer is not None:
        held.add("optimizer state", *(t for _, t in tensor_leaves(list(optimizer.state.values()))))
    registration = registration_of(inner)
    parts = [sharded_parameters.sharding_of(inner), sharded_optimizer.sharding_of(inner), strategy_of(inner),
             registration.sync if registration is not None else None]
    for part in parts:
        if part is not None:
            held.extend(part.held())
    context = context_of(inner)  # cp: the whole batch in hand, its masks
    if context is not None:
        held.extend(context.held())
    for _, layer in mp_modules(inner):
        reducer = reducer_of(layer.group)
        if reducer is not None:
            reducer.held(held)
    return held


def _span(t: torch.Tensor) -> Span | None:
    """The storage behind ``t`` (what it wraps, for a tensor without storage of its own); None for none."""
    for attribute in ("_local_tensor", "local"):  # a DTensor's local part; a ShardedGrad's slice
        inner = getattr(t, attribute, None)
        if torch.is_tensor(inner) and inner is not t:
            return _span(inner)
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    start, size = storage.data_ptr(), storage.nbytes()
    return (start, start + size) if size else None


def _address(mapping: mmap.mmap) -> Span:
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return start, start + len(mapping)


def _minus(span: Span, taken: list[Span]) -> list[Span]:
    """The parts of ``span`` no span of ``taken`` covers."""
    left = [span]
    for a, b in taken:
        left = [piece for lo, hi in left for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[0] < piece[1]]
    return left


def _count(held: Held, rank: int, size: int) -> Memory:
    """Each storage under the first kind claiming it; bytes in a file of shared memory through the file."""
    files = [(_address(m), sharers) for m, sharers in held.files if not m.closed]
    by_kind: dict[str, list[Span]] = {kind: [] for kind in KINDS}
    seen: set[Span] = set()
    taken: list[Span] = []
    for kind in KINDS:
        for t in (t for k, t in held.tensors if k == kind):
            span = _span(t)
            if span is None or span in seen:  # views of one storage: counted once
                continue
            seen.add(span)
            fresh = _minus(span, [s for s in taken if s[0] < span[1] and s[1] > span[0]])
            by_kind[kind] += fresh
            taken += fresh
    outside = [f for f, _ in files]
    counted = {kind: float(sum(b - a for span in spans for a, b in _minus(span, outside)))
               for kind, spans in by_kind.items()}
    for (start, end), sharers in files:
        share = (end - start) / sharers
        for kind in KINDS[:4]:  # this rank's own tensors in the file (gradients that are views of its slot)
            inside = sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in by_kind[kind])
            mine = min(inside, share)
            counted[kind] += mine
            share -= mine
        counted["shared memory"] += share
    return Memory(counted, [(end - start, sharers) for (start, end), sharers in files], rank, size)
