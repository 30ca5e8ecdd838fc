"""``shard="gradients"`` (ZeRO stage 2): each bucket of gradients is reduce-scattered, not all-reduced, and each
data-parallel rank keeps only its part of the sum.

The gradient sync of :mod:`autodist.dp.grad_sync` runs as always (counts, weights, used-flags, buffers in
the last bucket); what changes is the bucket and how it is summed:

* a :class:`ScatteredBucket` holds its gradients padded to ``N x c`` numbers (``c = ceil(n / N)``), then the
  count, flags and buffers. Rank r owns part ``[r*c, (r+1)*c)`` of the gradients: the cut of
  :meth:`autodist.sharded.layout.Layout.of_groups`, with each bucket one group, so the optimizer's pieces
  and the gradient's parts are the same elements. After the sync, rank r's part sits in ``bucket.part``
  (``c`` numbers, kept between steps) and each parameter's ``.grad`` is a
  :class:`~autodist.sharded.grads.ShardedGrad` around its slice of it;
* buckets are packed into a *ring* of two buffers the size of the largest bucket (bucket k into buffer
  k mod 2), not into buffers of their own, and autograd's full gradient of a parameter is dropped as soon
  as it is packed, so between steps a rank holds ``1/N`` of the gradients plus the ring. Buckets are
  capped at ``1/(8N)`` of the gradients, at least 256 KiB and at most ``bucket_mb`` (:func:`ring_bytes`;
  a parameter larger than that is a bucket of its own), so the ring is at most ``1/(4N)`` of them or two
  buckets. Between syncs the ring is free: the updated parameters are gathered through it after a step
  (:mod:`autodist.sharded.gather`);
* a bucket larger than a buffer of the ring (one parameter larger than the cap, or under
  ``shard="parameters"`` a block, which is one bucket) is packed and summed *window by window* through the
  ring: each window holds the same numbers of every rank's part (in shared memory the count and flags
  ride in the last one; through the backend each window is one reduce-scatter and they are all-reduced
  after), so the ring is two buffers of the cap at most, whatever the largest parameter or block;
* :class:`ScatterSum` (every rank on one machine, gloo, CPU): the ring lives in shared memory, one slot per
  rank. When bucket k is packed, a fence (:mod:`autodist.runtime.shared_fence`) says every rank has packed
  it; rank r adds up part r of every rank's slot, in rank order, into its ``part`` (the same bits as the
  whole-gradient sum), and the count and flags of every slot into the bucket's ``meta``. Packing bucket k
  where bucket k-2 was is safe: every rank entered bucket k-1's fence after summing bucket k-2. One more
  fence at the end of the sync frees the ring for the next;
* :class:`ReduceScatter` otherwise: the backend's asynchronous ``reduce_scatter`` of the gradients into
  ``part`` and ``all_reduce`` of the meta, started as each bucket (or window) fills; packing into a
  buffer of the ring first waits for the reduce-scatter that last read it.

A gradient still in ``.grad`` from the last sync when a backward adds to it (no ``zero_grad`` in between,
or ``zero_grad(set_to_none=False)``) is carried: it leaves ``.grad`` before autograd accumulates and its
slice is added to the new sum, as one process would have added the two gradients.

Example:
    >>> model, loader = autodist.parallelize(model, loader, shard="gradients")
    >>> loss_fn(model(x), y).backward()   # each rank now holds 1/N of the averaged gradients
    >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp.buckets import Bucket, assign_buckets
from autodist.runtime.comm import reduce_scatter_single
from autodist.runtime.held import Held
from autodist.runtime.position import waiting
from autodist.runtime.shared_slots import Shared, shared_slots
from autodist.sharded.gather import Windows
from autodist.sharded.grads import ShardedGrad
from autodist.sharded.layout import Layout

RING = 2  # buffers the buckets are packed into in turn
SMALLEST = 256 << 10  # bytes: the smallest bucket cap (each bucket costs a collective)


class ScatteredBucket(Bucket):
    """A bucket whose sum each rank keeps only its part of (see the module docstring)."""

    level = "gradients"  # the shard= level, which the gradients' errors name (set by the Scatter)

    def __init__(self, params: list[nn.Parameter], extra: int, rank: int, ranks: int, group: Any) -> None:
        self.rank, self.ranks, self.group = rank, ranks, group
        cut = Layout.of_groups(params, [list(range(len(params)))], ranks).kinds[0]  # the optimizer's cut, too
        self.chunk = cut.chunk
        # packed into a ring buffer of the exchange's (move_into): nothing of its own but the part and the meta
        super().__init__(params, extra, pad=self.chunk * ranks - cut.total, device=torch.device("meta"))
        like = params[0]
        self.part = torch.zeros(self.chunk, dtype=like.dtype, device=like.device)
        # What the exchange sums into: the part itself, or for float16 and bfloat16 gradients a float32 part,
        # made for each sync and rounded into ``part`` once at its end (widened: see Bucket)
        self.summed: torch.Tensor | None = None if self.widened else self.part
        self.meta = torch.zeros(self.flat.numel() - self.count_slot, dtype=self.flat.dtype, device=like.device)
        # each parameter's slice of ``part`` (empty where this rank owns none): at most one piece per parameter
        self.locals = [self.part[:0]] * len(params)
        for piece in cut.pieces[rank]:
            self.locals[piece.index] = piece.in_chunk(self.part)
        self.carried: dict[nn.Parameter, torch.Tensor] = {}
        self.after_pack: Callable[[], None] | None = None  # shard="parameters": the block's parameters freed
        # Larger than the ring's buffers: packed window by window (numbers of each rank's part per window), the
        # count, flags and buffers staged here meanwhile, the gradients and their scale held until then
        self.window: int | None = None
        self.staged: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] | None = None
        self.scale = 1.0

    def windowed(self, numbers: int) -> None:
        """Pack this bucket window by window, ``numbers`` of each rank's part at a time (the exchange's ring is
        smaller than the bucket; see :class:`ScatterSum`)."""
        self.window = numbers
        self.staged = torch.zeros_like(self.meta)
        self.extra = self.staged[1 + len(self.params):]  # the buffers that ride in the last bucket are packed here

    def windows(self) -> list[tuple[int, int]]:
        """The windows of each rank's part: numbers [lo, hi) of it."""
        assert self.window is not None
        return [(lo, min(self.chunk, lo + self.window)) for lo in range(0, self.chunk, self.window)]

    def gradients(self) -> torch.Tensor:
        """The region reduce-scattered: the gradients and their padding (``ranks x chunk`` numbers)."""
        return self.flat[:self.count_slot]

    def pack(self, count: float, scale: float, own: tuple[int, int] | None = None) -> None:
        if self.window is not None:  # the exchange packs it window by window (pack_window), then packed()
            grads = [p.grad for p in self.params]
            if any(g is not None and g.is_sparse for g in grads):
                raise NotImplementedError("sparse gradients (e.g. nn.Embedding(sparse=True)) are not supported; "
                                          "use dense gradients")
            assert self.staged is not None
            meta = [count, *(0.0 if g is None else 1.0 for g in grads)]
            self.staged[:len(meta)].copy_(torch.tensor(meta, dtype=self.staged.dtype))
            self.grads, self.scale = grads, scale
            self._ready_sum()
            return
        self._ready_sum()
        super().pack(count, scale)  # every number: each rank's part is summed on its own, no part is left out
        self.packed()

    def pack_window(self, lo: int, hi: int, slot: torch.Tensor) -> None:
        """Numbers [lo, hi) of every rank's part, scaled as :meth:`Bucket.pack` scales them (zeros for a missing
        gradient and for the padding), into ``slot``: rank 0's, then rank 1's, ..."""
        assert self.grads is not None
        n, total = hi - lo, self.offsets[-1] + self.params[-1].numel()
        for r in range(self.ranks):
            a, b, out = r * self.chunk + lo, r * self.chunk + hi, slot[r * n:(r + 1) * n]
            if b > total:
                out[max(0, total - a):].zero_()  # the padding after the last gradient
            for offset, p, g in zip(self.offsets, self.params, self.grads):
                x, y = max(a, offset), min(b, offset + p.numel())
                if x >= y:
                    continue
                into = out[x - a:y - a]
                if g is None or self.scale == 0.0:
                    into.zero_()
                elif self.scale == 1.0:
                    into.copy_(g.reshape(-1)[x - offset:y - offset])
                elif g.dtype != into.dtype:  # into the bucket's dtype first (float32 for bf16), weighted there
                    into.copy_(g.reshape(-1)[x - offset:y - offset]).mul_(self.scale)
                else:
                    torch.mul(g.reshape(-1)[x - offset:y - offset], self.scale, out=into)

    def _ready_sum(self) -> None:
        """The float32 part this sync's sum goes into, for float16 and bfloat16 gradients."""
        if self.widened and self.summed is None:
            self.summed = torch.empty(self.chunk, dtype=self.flat.dtype, device=self.part.device)

    def packed(self) -> None:
        """Every number packed: autograd's whole gradients are freed now."""
        self.grads = None
        for p in self.params:
            p.grad = None
        if self.after_pack is not None:
            self.after_pack()

    def total(self) -> float:
        return float(self.meta[0])

    def summed_extra(self) -> torch.Tensor:
        return self.meta[1 + len(self.params):]

    def carry(self, p: nn.Parameter) -> None:
        """A backward is about to add to ``p``'s sharded gradient: keep its slice, to add to the new sum."""
        grad = p.grad
        if isinstance(grad, ShardedGrad):
            self.carried[p] = grad.local.clone()
            p.grad = None

    def unpack(self, correction: float, copy_back: bool) -> None:
        self.sent = False
        self.ready.clear()
        used = self.meta[1:1 + len(self.params)].tolist()
        assert self.summed is not None
        if correction != 1.0:
            self.summed.mul_(correction)
        if self.widened:  # the float32 sum rounded to the parameters' dtype, once
            self.part.copy_(self.summed)
            self.summed = None
        for p, local, flag in zip(self.params, self.locals, used):
            carried = self.carried.pop(p, None)
            if flag <= 0.0 and carried is None:
                p.grad = None
                continue
            if carried is not None:
                local.copy_(carried) if flag <= 0.0 else local.add_(carried)
            p.grad = ShardedGrad(p, local, self.group, self.level)

    def abandon(self) -> None:
        self.carried.clear()
        self.grads = None
        if self.widened:
            self.summed = None

    def held(self, held: Held) -> None:
        """This rank's part of the sum (the gradients ``.grad`` holds a slice of each) and the meta; the ring
        the bucket is packed into is the exchange's."""
        held.add("gradients", self.part)
        held.add("autodist buffers", self.meta, self.staged, *self.carried.values())
        if self.summed is not None and self.summed is not self.part:
            held.add("autodist buffers", self.summed)


class ScatterSum:
    """The ring in shared memory: each rank sums its part of every rank's slot (see the module docstring)."""

    name = "shared memory"

    def __init__(self, buckets: list[ScatteredBucket], shared: Shared, rank: int) -> None:
        self.buckets, self.rank = buckets, rank
        self.mapping, self.fence = shared.mapping, shared.fence  # the ring is views of the mapping
        self.ring = shared.slots  # ring buffer k: a slot per rank
        # The ring's buffers are used in turn, a bucket once, a windowed bucket once per window: use u goes into
        # buffer u mod RING. Bucket k's slot of every rank: the first numbers of the buffer of its (first) use.
        self.first_use = _first_uses(buckets)
        self.slots = [[slot[:b.flat.numel()] for slot in shared.slots[u % len(shared.slots)]]
                      if b.window is None else [] for u, b in zip(self.first_use, buckets)]

    def place(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slot for bucket ``index`` (a windowed bucket stays where it is: it is packed in send)."""
        return self.slots[index][self.rank] if self.slots[index] else flat

    def claim(self, index: int) -> None:
        """Nothing to wait for: every rank passed the fence of the ring's last use after reading the use
        before, which was in the buffer this one packs into."""

    def own(self, index: int) -> None:
        """Every number of a bucket is packed: the whole gradient is freed after packing."""
        return None

    def send(self, index: int, flat: torch.Tensor, own: None = None) -> None:
        bucket = self.buckets[index]
        if bucket.window is not None:
            return self._send_windows(index, bucket)
        with waiting("exchange"):  # a rank that never packs it is named as in any gradient sync
            self.fence.wait()  # every rank has packed bucket ``index``
        slots = self.slots[index]
        lo, hi, meta = self.rank * bucket.chunk, (self.rank + 1) * bucket.chunk, bucket.count_slot
        _sum_into(bucket.summed, [s[lo:hi] for s in slots])
        _sum_into(bucket.meta, [s[meta:] for s in slots])

    def _send_windows(self, index: int, bucket: ScatteredBucket) -> None:
        """A bucket larger than the ring's buffers, window by window: each rank packs numbers [lo, hi) of every
        rank's part into its slot of the next buffer (the count, flags and buffers after the last window's),
        a fence, and each rank sums its own numbers of every slot into its part."""
        meta, size = bucket.meta.numel(), bucket.ranks
        for w, (lo, hi) in enumerate(bucket.windows()):
            slots, n = self.ring[(self.first_use[index] + w) % len(self.ring)], hi - lo
            bucket.pack_window(lo, hi, slots[self.rank])
            last = hi == bucket.chunk
            if last:
                assert bucket.staged is not None
                slots[self.rank][size * n:size * n + meta].copy_(bucket.staged)
            with waiting("exchange"):
                self.fence.wait()  # every rank has packed this window
            _sum_into(bucket.summed[lo:hi], [s[self.rank * n:(self.rank + 1) * n] for s in slots])
            if last:
                _sum_into(bucket.meta, [s[size * n:size * n + meta] for s in slots])
        bucket.packed()

    def finish(self) -> None:
        self.fence.wait()  # every rank has read the ring: it may be packed again

    def abandon(self) -> None:
        for bucket in self.buckets:
            bucket.abandon()

    def held(self, held: Held) -> None:
        held.share(self.mapping, len(self.ring[0]) if self.ring else 1)

    def windows(self) -> Windows:
        """The ring, free between syncs, as the windows the updated parameters are gathered through after a
        step (:mod:`autodist.sharded.gather`)."""
        return Windows(self.ring, self.fence)


class ReduceScatter:
    """The backend's reduce-scatter of each bucket's gradients out of the ring, all-reduce of its meta,
    overlapping backward; a bucket larger than a buffer of the ring window by window, as :class:`ScatterSum`
    does (each window one reduce-scatter of the same numbers of every rank's part)."""

    name = "reduce-scatter"

    def __init__(self, buckets: list[ScatteredBucket], ring: list[torch.Tensor], group: Any) -> None:
        self.buckets, self.ring, self.group = buckets, ring, group
        self.first_use = _first_uses(buckets)
        self.homes = [None if b.window is not None else ring[u % len(ring)][:b.flat.numel()]
                      for u, b in zip(self.first_use, buckets)]
        self.works: list[list[Any]] = [[] for _ in buckets]
        self.reading: list[Any] = [None] * len(ring)  # the reduce-scatter reading each buffer of the ring

    def place(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """The buffer of the ring bucket ``index`` is packed into (a windowed bucket is packed in send)."""
        home = self.homes[index]
        return flat if home is None else home

    def claim(self, index: int) -> None:
        """Bucket ``index`` is packed into the buffer an earlier use of the ring was sent from: wait for that."""
        if self.homes[index] is not None:
            self._free(self.first_use[index] % len(self.ring))

    def own(self, index: int) -> None:
        """Every number of a bucket is packed: the whole gradient is freed after packing."""
        return None

    def send(self, index: int, flat: torch.Tensor, own: None = None) -> None:
        bucket = self.buckets[index]
        if bucket.window is not None:
            return self._send_windows(index, bucket)
        bucket.meta.copy_(flat[bucket.count_slot:])
        scatter = reduce_scatter_single(bucket.summed, bucket.gradients(), group=self.group, async_op=True)
        self.reading[self.first_use[index] % len(self.ring)] = scatter
        self.works[index] = [scatter, dist.all_reduce(bucket.meta, group=self.group, async_op=True)]

    def _send_windows(self, index: int, bucket: ScatteredBucket) -> None:
        """Each window: numbers [lo, hi) of every rank's part packed into the next buffer of the ring, then
        reduce-scattered into this rank's ``part[lo:hi]``; the count, flags and buffers all-reduced after."""
        for w, (lo, hi) in enumerate(bucket.windows()):
            buffer = (self.first_use[index] + w) % len(self.ring)
            self._free(buffer)
            region = self.ring[buffer][:bucket.ranks * (hi - lo)]
            bucket.pack_window(lo, hi, region)
            scatter = reduce_scatter_single(bucket.summed[lo:hi], region, group=self.group, async_op=True)
            self.reading[buffer] = scatter
            self.works[index].append(scatter)
        assert bucket.staged is not None
        bucket.meta.copy_(bucket.staged)
        self.works[index].append(dist.all_reduce(bucket.meta, group=self.group, async_op=True))
        bucket.packed()

    def _free(self, buffer: int) -> None:
        """Wait until nothing reads ``buffer`` of the ring."""
        work, self.reading[buffer] = self.reading[buffer], None
        if work is not None:
            work.wait()

    def _wait(self, index: int) -> None:
        for work in self.works[index]:
            work.wait()
        self.works[index] = []

    def finish(self) -> None:
        for index in range(len(self.buckets)):
            self._wait(index)
        self.reading = [None] * len(self.ring)

    def abandon(self) -> None:
        self.finish()
        for bucket in self.buckets:
            bucket.abandon()

    def held(self, held: Held) -> None:
        held.add("autodist buffers", *self.ring)


def _first_uses(buckets: list[ScatteredBucket]) -> list[int]:
    """The ring's buffers are used in turn, a bucket once, a windowed bucket once per window (use u goes into
    buffer u mod RING): each bucket's first use."""
    first, uses = [], 0
    for b in buckets:
        first.append(uses)
        uses += 1 if b.window is None else len(b.windows())
    return first


def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``out`` = the sum of ``parts``, added in rank order (every rank adds the same numbers the same way)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


def ring_bytes(total: int, ranks: int, cap: int) -> int:
    """The most bytes a buffer of the ring holds, for ``total`` bytes of gradients over ``ranks`` ranks: 1/(8N) of
    them (nor less than 256 KiB), at most ``cap`` (``bucket_mb``). The windows the updated parameters are
    gathered through are as large (:mod:`autodist.sharded.gather`).

    Example:
        >>> ring_bytes(32 << 20, 2, 25 << 20) == 2 << 20
        True
    """
    return min(cap, max(SMALLEST, total // (8 * ranks)))


class Scatter:
    """What :class:`~autodist.dp.grad_sync.GradSync` uses under ``shard="gradients"``: its buckets and how they
    are summed. ``rank`` of ``ranks``: this rank's place in the data-parallel ``group``."""

    level = "gradients"  # the shard= level it serves

    def __init__(self, group: Any, rank: int, ranks: int) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        self.cap = SMALLEST  # bytes a buffer of the ring holds in shared memory (set by assign)

    def _set_cap(self, params: list[nn.Parameter], bucket_bytes: int) -> int:
        self.cap = ring_bytes(sum(p.numel() * p.element_size() for p in params), self.ranks, bucket_bytes)
        return self.cap

    def assign(self, params: list[nn.Parameter], caps: tuple[int, int]) -> list[list[int]]:
        """The buckets (indices into ``params``, in the order they are sent): as for the whole-gradient sync,
        but no larger than 1/(8N) of the gradients (nor than 256 KiB less), so that the ring of two holds
        at most 1/(4N) of them beside the 1/N a rank keeps (``bucket_mb`` is for the whole-gradient sync,
        where a bucket's memory is its gradients' own)."""
        cap = self._set_cap(params, caps[1])
        return assign_buckets(params, min(caps[0], cap), cap)

    def bucket(self, params: list[nn.Parameter], extra: int) -> ScatteredBucket:
        bucket = ScatteredBucket(params, extra, self.rank, self.ranks, self.group)
        bucket.level = self.level
        return bucket

    def choose(self, buckets: list[Bucket], group: Any) -> ScatterSum | ReduceScatter:
        """The shared-memory ring where the group is on one machine, the backend's reduce-scatter otherwise.
        A collective over ``group``."""
        scattered = [b for b in buckets if isinstance(b, ScatteredBucket)]
        assert len(scattered) == len(buckets), "shard='gradients' builds its own buckets"
        ring = _ring(scattered, self._windowed(scattered))
        shared = shared_slots(ring, group, "the sharded gradient buckets")
        if shared is not None:
            return ScatterSum(scattered, shared, self.rank)
        return ReduceScatter(scattered, ring, group)

    def _windowed(self, buckets: list[ScatteredBucket]) -> int:
        """The numbers a buffer of the ring in shared memory holds: a cap's worth (and any bucket that fits
        it); a bucket larger than that (a parameter, a block larger than the cap) is packed window by window."""
        like = buckets[0].meta if buckets else torch.zeros(0)  # the dtype gradients are summed in
        size = max(self.cap // like.element_size(), max((b.meta.numel() for b in buckets), default=0) + self.ranks)
        for bucket in buckets:
            if bucket.flat.numel() > size:
                bucket.windowed((size - bucket.meta.numel()) // self.ranks)
        return size if any(b.window is not None for b in buckets) else 0  # 0: each buffer as its largest bucket

    def backward_ended(self) -> None:
        """Nothing to do at the end of a backward (``shard="parameters"`` frees its blocks there)."""


def _ring(buckets: list[ScatteredBucket], size: int) -> list[torch.Tensor]:
    """RING buffers (fewer if there are fewer buckets) of ``size`` numbers, or (``size`` 0) each as large as the
    largest bucket packed into it."""
    sizes = [0] * min(RING, len(buckets))
    for k, b in enumerate(buckets):
        sizes[k % RING] = size or max(sizes[k % RING], b.flat.numel())
    first = buckets[0].meta if buckets else torch.zeros(0)  # the dtype gradients are summed in
    if any(b.meta.dtype != first.dtype or b.meta.device != first.device for b in buckets):
        raise NotImplementedError("shard='gradients' needs every trainable parameter summed in one dtype on one "
                                  "device (float16, bfloat16 and float32 are summed in float32): convert the "
                                  "model with model.to(dtype) first, or use shard='optimizer'")
    return [torch.zeros(n, dtype=first.dtype, device=first.device) for n in sizes]
