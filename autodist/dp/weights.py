"""The weights of the backwards between two gradient syncs.

Rank r's gradient of a backward through a batch it holds n_r of, out of a
global N, enters the global gradient as (n_r / N) g_r. Between two syncs
autograd sums several backwards into ``.grad`` (gradient accumulation), so
each must carry its own weight a_k = n_rk / N_k. The first backward with a
non-zero weight sets the window's *common* weight a_c; a later backward whose
weight differs has its gradient multiplied by a_k / a_c before autograd adds it
(zero for an empty batch, whose loss is NaN), so that ``.grad`` holds
(1 / a_c) sum_k a_k g_k and the bucket, scaled by a_c when packed, holds
sum_k a_k g_k. The usual loop (every micro-batch the same share) multiplies
nothing but the packing.

When N is not known on the rank (data autodist did not shard, or a count read
from the loss: its valid tokens), the bucket carries n_r, whose all-reduced sum
is N: gradients are packed scaled by n_r / G and corrected by G / N after the
all-reduce only where the two differ. G is the window's guess where each
backward brought one (the loader's N for a count read from the loss, so that a
loss that is a mean over the samples after all is packed as the loader's count
would pack it), else the last sync's N; either is the same on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autodist.dp.shares import Counted, add_marks


@dataclass(frozen=True)
class Pack:
    """How the buckets of one sync are packed and what their count slots must add up to."""

    scale: float  # gradients are multiplied by this while copied into the bucket
    count: float  # this rank's entry in the count slot (NaN: this rank could not count)
    expected: float | None  # the all-reduced count slot when every rank knew its N; None: it is N
    previous_total: float  # G, when expected is None


class Window:
    """The backwards since the last sync: their summed counts and the common weight."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.backwards = 0
        self.count = 0.0
        self.total: float | None = 0.0  # None once a backward's N was unknown
        self.common: float | None = None  # a_c
        self.error: str | None = None
        self.mark: int | None = 0  # the identity of the window's global batches; None: one came from elsewhere
        self.guess: float | None = 0.0  # the sum of the backwards' guesses of N; None once one had none

    def factor(self, counted: Counted) -> float:
        """What a backward of ``counted`` must multiply its gradient by before accumulation."""
        if counted.total is None:
            return 1.0  # N unknown: weighted as a whole at the sync
        weight = counted.weight
        if weight == 0.0:
            return 0.0
        return 1.0 if self.common is None or weight == self.common else weight / self.common

    def add(self, counted: Counted) -> None:
        self.backwards += 1
        self.count += counted.count
        self.total = None if self.total is None or counted.total is None else self.total + counted.total
        if counted.total is not None and counted.weight > 0.0 and self.common is None:
            self.common = counted.weight
        self.error = self.error or counted.error
        self.mark = add_marks((self.mark, counted.mark))
        self.guess = None if self.guess is None or counted.guess is None else self.guess + counted.guess

    def pack(self, previous_total: float) -> Pack:
        """The packing of a sync of everything added since the last reset."""
        if self.error is not None or math.isnan(self.count):
            return Pack(0.0, math.nan, None, previous_total)
        if self.total is not None:
            return Pack(self.common or 0.0, self.count, self.total, previous_total)
        guess = self.guess if self.guess else previous_total
        return Pack(self.count / guess, self.count, None, guess)
