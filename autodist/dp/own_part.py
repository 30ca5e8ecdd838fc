"""The part of a bucket a rank sums itself, read from and written to autograd's gradients where they are.

Through shared memory (:class:`autodist.dp.exchange.SharedSum`) rank r adds up
part r of every rank's bucket. The other ranks read their parts of rank r's
slot, so those must be packed there; part r only rank r reads. So a bucket
packs every number but its gradients in part r (:meth:`Bucket.pack
<autodist.dp.buckets.Bucket.pack>`), and the sum reads them from the gradients
themselves, scaled as packing would have scaled them (:meth:`OwnPart.split`
says where each piece is read from and where its sum goes). After gradient
accumulation, where the bucket is copied back into autograd's tensors, the
sum of part r goes straight into them, built up in place, and the copy
back skips it. Per bucket of B bytes on 2 ranks that
leaves packing B/2 and the copy back B/2 instead of B each: 1.5 passes over
the bucket in all instead of 2, 2 instead of 3 after accumulation
(``benchmarks/bench_floor.py``). The numbers are the same: each is scaled by
the same multiply and added in the same rank order (the first two of a sum
may swap: IEEE addition is commutative).

Example:
    >>> part = OwnPart(slot, [(0, 6, grad.view(-1))], scale=0.5, into_grads=False)
    >>> [(o.lo, o.hi) for o in part.split([(0, 4), (4, 8)])]   # 0.5 x the gradient's numbers; 6, 7 in the slot
    [(0, 4), (4, 6), (6, 8)]
"""
from __future__ import annotations

import torch

from autodist.runtime.shared_slots import Own

Segment = tuple[int, int, torch.Tensor]  # numbers [a, b) of the bucket are the gradient's numbers (b - a of them)


class OwnPart:
    """This rank's part of one bucket: where its gradient numbers are (``segments``, in bucket order), the scale
    they are packed with, and whether the sum goes into the gradients (``into_grads``) or this rank's slot.
    Numbers of the part no segment covers (padding, the sample count, the flags) are in the slot, packed."""

    def __init__(self, slot: torch.Tensor, segments: list[Segment], scale: float, into_grads: bool) -> None:
        self.slot, self.segments, self.scale, self.into_grads = slot, segments, scale, into_grads

    def split(self, pieces: list[tuple[int, int]]) -> list[Own]:
        """``pieces`` of this rank's part cut where a gradient begins or ends: each piece's numbers, where they
        are read from and where their sum goes (see :func:`~autodist.runtime.shared_slots.sum_from_own`)."""
        found, k = [], 0
        for lo, hi in pieces:
            done = lo
            while done < hi:
                while k < len(self.segments) and self.segments[k][1] <= done:
                    k += 1
                a, b, grad = self.segments[k] if k < len(self.segments) else (hi, hi, None)
                if done < a:  # numbers no gradient holds (the padding, the count, the flags): packed in the slot
                    end = min(a, hi)
                    found.append(Own(done, end, self.slot[done:end], self.slot[done:end], 1.0))
                else:
                    end = min(b, hi)
                    source = grad[done - a:end - a]
                    found.append(Own(done, end, source, source if self.into_grads else self.slot[done:end],
                                     self.scale))
                done = end
        return found

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
