"""Handing a rank's part of a global batch to the training loop: which rows are this rank's, and what the loop
is told with each batch (its share of the global batch, which weights the gradient; the step, for the watchdog
and the progress lines). Used by the map-style loader (:mod:`autodist.dp.data`) and the stream's
(:mod:`autodist.dp.stream`).

Example:
    >>> slice_bounds(11, 2, 3)
    (8, 11)
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

from autodist.dp.loader_position import Position
from autodist.faults import watchdog
from autodist.runtime import position, provenance
from autodist.runtime.provenance import BatchShare


def slice_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous part of n items; the first n % size ranks get one more.

    Example:
        >>> [slice_bounds(5, r, 3) for r in range(3)]
        [(0, 2), (2, 4), (4, 5)]
    """
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def handed_over(batches: Iterator[Any], shares: deque[BatchShare], epoch: tuple[str, int, int, int],
                place: Position, cut: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """``batches`` as the loop takes them, each with the next of ``shares`` (filled as each batch is made)
    announced; ``epoch``: (the loader's key, the epoch's number, its steps or -1, its samples or -1), for the
    watchdog, which raises at the end if another rank has more steps; ``place`` counts the batches taken (from
    where a resumed epoch begins); ``cut``: what each batch becomes before the loop takes it (context
    parallelism's: this rank's tokens of each sequence), None for the batch as it is."""
    outer = provenance.current()  # an evaluation loop inside a training loop gives the training batch back
    key, number, steps, samples = epoch
    step = place.taken
    try:
        for batch in batches:
            share = shares.popleft()
            if cut is not None:
                batch = cut(batch)
            provenance.register_batch(batch, share)
            provenance.announce(share, batch)
            step += 1
            place.took(share.mark)
            position.record.batch(share.batch, (number, step, steps))
            yield batch
        watchdog.data_ended(key, number, step, samples)  # raises if another rank has more steps
        place.end()
    finally:
        provenance.announce(outer)
