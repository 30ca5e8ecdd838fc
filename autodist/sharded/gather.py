"""The all-gather after a sharded step: every rank's updated pieces into every rank's parameters.

Under ``shard="optimizer"`` and ``"gradients"`` each data-parallel rank updates its pieces of the
parameters (:mod:`autodist.sharded.layout`), then every rank needs every element again. The pieces of one
dtype and device form a *stream*: each kind's chunk after the other, rank r's stream holding its own pieces,
at the same places on every rank.

On one machine the streams meet in shared memory, through two *windows* used in turn, each a slot of ``W``
numbers per rank: each rank copies what of its stream falls in the current window into its slot, a fence
(:mod:`autodist.runtime.shared_fence`) says every rank has, and each rank copies the others' slots into its
parameters. Window k + 2 reuses window k's memory: every rank passed window k + 1's fence after reading
window k. One more fence at the end frees the windows for the next step. So the memory is two windows,
whatever the size of the model: a rank's share of the file is 2 W numbers. Under ``shard="gradients"`` the
windows are the two ring buffers the gradient buckets were packed into (:mod:`autodist.sharded.scatter`),
free between syncs, so the gather costs no memory of its own. Elsewhere the backend all-gathers each
kind's chunk.

Example:
    >>> k = 0
    >>> for stream, win in zip(streams(layout.kinds, ranks), windows):   # after the step, on every rank
    ...     k = through_windows(stream, rank, win, param_slice, k)
    >>> windows[0].fence.wait()                                          # the windows are free again
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from autodist.sharded.layout import Kind, Piece

Slice = Callable[[Piece], torch.Tensor]  # a piece's elements in its parameter


@dataclass(frozen=True)
class Run:
    """A piece's place in its owner's stream: numbers ``[at, at + n)``."""

    at: int
    n: int
    piece: Piece


@dataclass
class Stream:
    """The kinds of one dtype and device, chunk after chunk: the runs of each rank, in stream order."""

    dtype: torch.dtype
    device: torch.device
    length: int
    runs: list[list[Run]]


def streams(kinds: list[Kind], ranks: int) -> list[Stream]:
    """The kinds of each dtype and device as one stream (in the order the kinds come)."""
    found: dict[tuple, Stream] = {}
    for kind in kinds:
        stream = found.setdefault((kind.dtype, kind.device), Stream(kind.dtype, kind.device, 0,
                                                                                 [[] for _ in range(ranks)]))
        for r in range(ranks):
            stream.runs[r] += [Run(stream.length + p.at, p.stop - p.start, p) for p in kind.pieces[r]]
        stream.length += kind.chunk
    return list(found.values())


class Windows:
    """Two (or one) regions of shared memory, each a slot per rank (the same numbers of one dtype), and the
    fence of their file."""

    def __init__(self, regions: list[list[torch.Tensor]], fence: Any) -> None:
        self.regions, self.fence = regions, fence


def through_windows(stream: Stream, rank: int, windows: Windows, param: Slice, first: int = 0) -> int:
    """Gather ``stream`` through ``windows`` (the module docstring), starting with window number ``first`` (a
    stream after another continues the count); returns the next window's number. The caller ends with one
    more ``windows.fence.wait()``."""
    k, start, regions = first, 0, windows.regions
    while start < stream.length:
        slots = regions[k % len(regions)]
        end = min(stream.length, start + slots[rank].numel())
        if len(regions) == 1 and k > first:
            windows.fence.wait()  # a single region: every rank read the last window before it is written again
        for run, lo, hi in _within(stream.runs[rank], start, end):
            slots[rank][lo - start:hi - start].copy_(param(run.piece)[lo - run.at:hi - run.at])
        windows.fence.wait()  # every rank wrote this window
        for r, theirs in enumerate(stream.runs):
            if r != rank:
                for run, lo, hi in _within(theirs, start, end):
                    param(run.piece)[lo - run.at:hi - run.at].copy_(slots[r][lo - start:hi - start])
        start, k = end, k + 1
    return k


def _within(runs: list[Run], start: int, end: int) -> list[tuple[Run, int, int]]:
    """The runs that overlap ``[start, end)``, each with the overlap."""
    return [(run, max(start, run.at), min(end, run.at + run.n)) for run in runs
            if run.at < end and run.at + run.n > start]
