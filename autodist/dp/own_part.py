"""The part of a bucket a rank sums itself, read from and summed into autograd's gradients where they are.

Through shared memory (:class:`autodist.dp.exchange.SharedSum`) rank r adds up
part r of every rank's bucket. The other ranks read their parts of rank r's
slot, so those must be packed there; part r only rank r reads. After gradient
accumulation, where the sum is copied back into autograd's tensors anyway
(see :meth:`Bucket.unpack <autodist.dp.buckets.Bucket.unpack>`), a large
model's bucket packs every number but its gradients in part r (:meth:`Bucket.pack
<autodist.dp.buckets.Bucket.pack>`); the sum scales them in the gradients
themselves, as packing would have, adds the other ranks' to them there
(:meth:`OwnPart.split` cuts the part where each gradient begins and ends) and
the copy back skips them. Per bucket of B bytes on 2 ranks that leaves packing
B/2 and the copy back B/2 instead of B each: 2 passes over the bucket instead
of 3 (``benchmarks/bench_floor.py``: the no_sync MLP's packing, sum and copy back
19.5 ms a step -> 13.4). The numbers are the same: each is scaled by the same
multiply and added in the same rank order (the first two of a sum may swap:
IEEE addition is commutative). Not taken after a single backward, where the
gradients become views of the slot: the sum would write part r into the slot,
fetching every line only to overwrite it (measured: the MLP's step 1.35 of
no communication without it, 1.41-1.44 with it).

Example:
    >>> part = OwnPart(slot, [(0, 6, grad.view(-1))], scale=0.5)
    >>> [(o.lo, o.hi) for o in part.split([(0, 4), (4, 8)])]   # 0.5 x the gradient's numbers; 6, 7 in the slot
    [(0, 4), (4, 6), (6, 8)]
"""
from __future__ import annotations

import torch

from autodist.runtime.shared_slots import Own

Segment = tuple[int, int, torch.Tensor]  # numbers [a, b) of the bucket are the gradient's numbers (b - a of them)


class OwnPart:
    """This rank's part of one bucket: where its gradient numbers are (``segments``, in bucket order) and the
    scale they are packed with. Numbers of the part no segment covers (padding, the sample count, the flags)
    are in the slot, packed, and their sum goes there."""

    def __init__(self, slot: torch.Tensor, segments: list[Segment], scale: float) -> None:
        self.slot, self.segments, self.scale = slot, segments, scale

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
                    found.append(Own(done, end, source, source, self.scale))
                done = end
        return found

    def correct(self, factor: float) -> None:
        """Multiply the sums written into the gradients by ``factor`` (as the bucket's own numbers are)."""
        for _, _, grad in self.segments:
            grad.mul_(factor)

    def outside(self, a: int, b: int) -> list[tuple[int, int]]:
        """The ranges of numbers [a, b) of the bucket outside this part's gradient numbers."""
        if not self.segments:
            return [(a, b)]
        lo, hi = self.segments[0][0], self.segments[-1][1]
        return [(x, y) for x, y in ((a, min(b, lo)), (max(a, hi), b)) if x < y]

    def pieces_outside(self, view: torch.Tensor, grad: torch.Tensor, offset: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One gradient's numbers outside this part, the gradient starting at ``offset`` of the bucket and
        ``view`` its numbers there: pairs of (the bucket's piece, the gradient's piece)."""
        return [(view.view(-1)[a - offset:b - offset], grad.view(-1)[a - offset:b - offset])
                for a, b in self.outside(offset, offset + grad.numel())]


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
