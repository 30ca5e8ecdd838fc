"""The part of a bucket a rank sums itself, read from and written to autograd's gradients where they are.

Through shared memory (:class:`autodist.dp.exchange.SharedSum`) rank r adds up
part r of every rank's bucket. The other ranks read their parts of rank r's
slot, so those must be packed there; part r only rank r reads. So a bucket
packs every number but its gradients in part r (:meth:`Bucket.pack
<autodist.dp.buckets.Bucket.pack>`), and the sum reads them from the gradients
themselves, scaled as packing would have scaled them, one piece at a time
into a buffer that stays in cache (:meth:`OwnPart.read`). After gradient
accumulation, where the bucket is copied back into autograd's tensors, the
sum of part r goes straight into them (:meth:`OwnPart.write`) and the copy
back skips it. Per bucket of B bytes on 2 ranks that
leaves packing B/2 and the copy back B/2 instead of B each: 1.5 passes over
the bucket in all instead of 2, 2 instead of 3 after accumulation
(``benchmarks/bench_floor.py``). The numbers are the same: each is scaled by
the same multiply and added in the same rank order (the first two of a sum
may swap: IEEE addition is commutative).

Example:
    >>> part = OwnPart(slot, [(0, 6, grad.view(-1))], scale=0.5, into_grads=False)
    >>> part.read(0, 4, out[:4])      # 0.5 x the gradient's first four numbers
    >>> part.write(0, 4, summed[:4])  # into the slot (or the gradient, with into_grads)
"""
from __future__ import annotations

from bisect import bisect_right

import torch

Segment = tuple[int, int, torch.Tensor]  # numbers [a, b) of the bucket are the gradient's numbers (b - a of them)


class OwnPart:
    """This rank's part of one bucket: where its gradient numbers are (``segments``, in bucket order), the scale
    they are packed with, and whether the sum goes into the gradients (``into_grads``) or this rank's slot.
    Numbers of the part no segment covers (padding, the sample count, the flags) are in the slot, packed."""

    def __init__(self, slot: torch.Tensor, segments: list[Segment], scale: float, into_grads: bool) -> None:
        self.slot, self.segments, self.scale, self.into_grads = slot, segments, scale, into_grads
        self.starts = [a for a, _, _ in segments]

    def _covering(self, lo: int, hi: int) -> list[tuple[int, int, torch.Tensor]]:
        """The segments' numbers within [lo, hi): (start, end, the gradient's numbers there)."""
        found = []
        for a, b, grad in self.segments[max(0, bisect_right(self.starts, lo) - 1):]:
            if a >= hi:
                break
            s, e = max(a, lo), min(b, hi)
            if s < e:
                found.append((s, e, grad[s - a:e - a]))
        return found

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` = this rank's packed numbers [lo, hi) of the bucket."""
        done = lo
        for s, e, grad in self._covering(lo, hi):
            if s > done:
                out[done - lo:s - lo].copy_(self.slot[done:s])
            if self.scale == 1.0:
                out[s - lo:e - lo].copy_(grad)
            else:
                torch.mul(grad, self.scale, out=out[s - lo:e - lo])
            done = e
        if done < hi:
            out[done - lo:].copy_(self.slot[done:hi])

    def write(self, lo: int, hi: int, summed: torch.Tensor) -> None:
        """Put the sum of numbers [lo, hi) where this rank keeps it: the gradients, or the slot."""
        if not self.into_grads:
            self.slot[lo:hi].copy_(summed)
            return
        done = lo
        for s, e, grad in self._covering(lo, hi):
            if s > done:
                self.slot[done:s].copy_(summed[done - lo:s - lo])
            grad.copy_(summed[s - lo:e - lo])
            done = e
        if done < hi:
            self.slot[done:hi].copy_(summed[done - lo:])

    def correct(self, factor: float) -> None:
        """Multiply the sums written into the gradients by ``factor`` (as the bucket's own numbers are)."""
        if self.into_grads:
            for _, _, grad in self.segments:
                grad.mul_(factor)

    def outside(self, a: int, b: int) -> list[tuple[int, int]]:
        """The ranges of numbers [a, b) of the bucket outside this part's gradient numbers."""
        if not self.segments:
            return [(a, b)]
        lo, hi = self.segments[0][0], self.segments[-1][1]
        return [(x, y) for x, y in ((a, min(b, lo)), (max(a, hi), b)) if x < y]


def segments(offsets: list[int], grads: list[torch.Tensor], lo: int, hi: int) -> list[Segment]:
    """Where the gradients' numbers within the bucket's [lo, hi) are: each gradient starting at its offset.

    Example:
        >>> [(a, b) for a, b, _ in segments([0, 4], [torch.ones(4), torch.ones(2)], 2, 6)]
        [(2, 4), (4, 6)]
    """
    found = []
    for offset, grad in zip(offsets, grads):
        s, e = max(offset, lo), min(offset + grad.numel(), hi)
        if s < e:
            found.append((s, e, grad.view(-1)[s - offset:e - offset]))
    return found
