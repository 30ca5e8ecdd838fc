"""The check that the data-parallel ranks of a step are on one global batch: its identity rides in the buckets.

Every rank's count of samples adding up to the global batch's is not enough: two ranks each handed half of a
different global batch add up too (a sampler that split the data parallelize returned again, a loop that skips
a batch on one rank, a sampler seeded differently per rank). A batch the sharded DataLoader hands out carries
a mark, the same on every rank that draws that global batch (:func:`autodist.dp.data.RankSliceBatchSampler`):
the mark's base-M digits d_1..d_4 (M small), each rank packs (1, d_1, d_1^2, ..., d_4, d_4^2) into nine slots
of the last bucket, and after the all-reduce every rank reads the same sums (K, S1, S2 per digit) and knows,
all alike, whether the K ranks that know their batch agree: K S2 = S1^2 exactly when their digits are equal
(Cauchy-Schwarz). M keeps the sums exact integers in float32 (P M^2 < 2^24: M = 256 up to 256 ranks, the
whole 32-bit mark); two different batches pass only where their marks agree modulo M^4 (1 in 2^32 up to 256
ranks, 1 in 10^8 at 1,000). Ranks whose step had no sharded-loader batch pack zeros and are not compared.

Example:
    >>> pack(region, mark=window.mark, ranks=2)    # before the all-reduce
    >>> check(region)                              # after it: raises on every rank alike if the ranks differ
"""
from __future__ import annotations

import math

import torch

from autodist.dp.buckets import to_device

DIGITS = 4  # of the mark, base M
SLOTS = 1 + 2 * DIGITS  # the tail of the last bucket these take


def _modulus(ranks: int) -> int:
    return max(2, min(256, math.isqrt((1 << 24) // max(ranks, 1))))


def pack(region: torch.Tensor, mark: int | None, ranks: int) -> None:
    """Write this rank's (1, d, d^2 for each digit d of the mark), or zeros for a step without a mark, into
    ``region`` (``SLOTS`` numbers)."""
    if mark is None:
        region.zero_()
        return
    base = _modulus(ranks)
    digits = [(mark // base ** i) % base for i in range(DIGITS)]
    region.copy_(to_device([1.0, *(float(v) for d in digits for v in (d, d * d))], region), non_blocking=True)


def check(region: torch.Tensor) -> None:
    """Raise, on every rank alike, if the summed ``region`` says the ranks that know their batch differ."""
    known, *sums = region.tolist()
    if known > 1 and any(known * second != first * first for first, second in zip(sums[::2], sums[1::2])):
        raise RuntimeError(
            f"the data-parallel ranks are not on the same global batch at this step: {known:g} ranks trained on "
            f"batches the sharded DataLoader handed out, and they are parts of different global batches. Something "
            f"between parallelize's DataLoader and the model splits or reorders it per rank (a DistributedSampler, "
            f"a framework's own loader around it: docs/frameworks.md), a rank skips a batch, the loader's "
            f"sampler draws from a generator seeded differently per rank, or a stream (an IterableDataset, which "
            f"every rank reads) yields different batches on different ranks (a shuffle buffer without a seed: seed "
            f"it alike on every rank); iterate the DataLoader parallelize returns as it is, on every rank alike")
