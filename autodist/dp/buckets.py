"""Flat communication buffers: which gradients share a bucket, packing them, and weighted averaging.

A bucket is one flat tensor holding several parameters' gradients, then the
sample count of the step and a used-flag per parameter, so one all-reduce
carries all of it. ``average_`` is the same idea for buffers and weights.
Used by :mod:`autodist.dp.grad_sync`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp.own_part import OwnPart, segments
from autodist.runtime.held import Held

MB = 1024 * 1024
LOW_PRECISION = (torch.float16, torch.bfloat16)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ranks' gradients of ``dtype`` are summed in: float32 for float16 and bfloat16, so that the
    sum is rounded to the parameter's dtype once, not once per rank (its error then does not grow with the
    number of ranks); ``dtype`` itself otherwise.

    Example:
        >>> sum_dtype(torch.bfloat16), sum_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in LOW_PRECISION else dtype


def assign_buckets(params: list[torch.Tensor], first_cap_bytes: int, cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, last parameter first, one dtype/device per bucket.

    Example:
        >>> ps = [torch.zeros(1000), torch.zeros(10), torch.zeros(10)]
        >>> assign_buckets(ps, first_cap_bytes=100, cap_bytes=10_000)
        [[2, 1], [0]]
    """
    buckets: list[list[int]] = []
    current: dict[tuple, tuple[int, int]] = {}  # (dtype, device) -> (bucket being filled, its bytes)
    first_of: dict[tuple, int] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        entry = current.get(key)
        if entry is not None:
            cap = first_cap_bytes if entry[0] == first_of[key] else cap_bytes
            if entry[1] + nbytes > cap:
                entry = None
        if entry is None:
            buckets.append([])
            entry = (len(buckets) - 1, 0)
            first_of.setdefault(key, entry[0])
        buckets[entry[0]].append(i)
        current[key] = (entry[0], entry[1] + nbytes)
    return buckets


# Below this many bytes of gradients in all, a model's are copied back into autograd's tensors after a sync
# (see Bucket.unpack).
COPY_BACK_BELOW_BYTES = 4 << 20


class Bucket:
    """One flat buffer: the gradients, then the sample count, a used-flag per parameter, then ``extra`` slots
    that other data of the same sync may ride in (the model's buffers, in the last bucket).

    Parameters of one dtype share a bucket. Float16 and bfloat16 gradients are packed into a float32 bucket
    (:func:`sum_dtype`), weighted and summed there, and rounded to their dtype once, when copied back."""

    def __init__(self, params: list[nn.Parameter], extra: int = 0, pad: int = 0, device: torch.device | None = None
                 ) -> None:
        self.params = params
        numel = sum(p.numel() for p in params) + pad  # ``pad`` numbers after the gradients, never read
        self.flat = torch.zeros(numel + 1 + len(params) + extra, dtype=sum_dtype(params[0].dtype),
                                device=params[0].device if device is None else device)
        self.widened = self.flat.dtype != params[0].dtype  # low precision, summed in float32
        self.count_slot = numel
        self.views, self.extra = self._layout(self.flat)
        # A small model's gradients are copied back into autograd's tensors after every sync, as DDP does;
        # a large one's become views of the bucket (see unpack). Set by the owner, who sees every bucket.
        self.copies_back = False
        self.ready: set[int] = set()
        self.sent = False  # packed and handed to the exchange in this sync
        self.own: OwnPart | None = None  # this sync's part the exchange sums from the gradients themselves

    def _layout(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each parameter's view of ``flat``, and its extra slots."""
        views, offset, self.offsets = [], 0, []
        for p in self.params:
            self.offsets.append(offset)
            views.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views, flat[self.count_slot + 1 + len(self.params):]

    def move_into(self, home: torch.Tensor) -> None:
        """Keep the bucket in ``home`` (as large, the same dtype) from now on: this rank's slot in shared memory,
        where the other ranks read it (see :mod:`autodist.dp.exchange`)."""
        if home is not self.flat:
            if self.flat.device.type != "meta":
                home.copy_(self.flat)
            self.flat = home
            self.views, self.extra = self._layout(home)

    def summed_extra(self) -> torch.Tensor:
        """The ``extra`` slots summed over the ranks, after the exchange."""
        return self.extra

    def held(self, held: Held) -> None:
        """The bucket's memory, for ``autodist.memory`` (a slot of shared memory counts with its file)."""
        held.add("autodist buffers", self.flat)

    def carry(self, p: nn.Parameter) -> None:
        """A backward is about to add to ``p.grad``: whole gradients need nothing done."""

    def abandon(self) -> None:
        """A backward failed midway: nothing of the bucket's is kept beyond the sync."""

    def pack(self, count: float, scale: float, own: tuple[int, int] | None = None) -> OwnPart | None:
        """Copy ``scale`` x each gradient into the bucket (zeros for a missing one), then the count and flags.

        A small model's bucket (``copies_back``) is packed with two batched ops (copy every gradient, scale
        the region), whose per-op cost in Python would otherwise be most of the packing; a large one's with
        one multiply per gradient, a single pass over its many bytes. ``own``, in a sync that copies back: the
        numbers [lo, hi) the exchange sums on this rank alone; in a large model's bucket whose gradients are
        all there to read (dense, contiguous, of their parameter's shape), those are left out and the
        returned :class:`~autodist.dp.own_part.OwnPart` says where in the gradients their sum is made.
        """
        grads = [p.grad for p in self.params]
        meta = [count, *(0.0 if g is None else 1.0 for g in grads)]
        if any(g is not None and g.is_sparse for g in grads):
            raise NotImplementedError("sparse gradients (e.g. nn.Embedding(sparse=True)) are not supported; "
                                      "use dense gradients")
        present = [(view, g) for view, g in zip(self.views, grads) if g is not None]
        region = self.flat[:self.count_slot]
        self.own = None
        if own is not None and scale != 0.0 and not self.copies_back and all(
                g is not None and g.is_contiguous() and g.shape == v.shape and g.dtype == v.dtype
                and g.data_ptr() != v.data_ptr() for v, g in zip(self.views, grads)):
            self.own = OwnPart(self.flat, segments(self.offsets, grads, *own), scale)
            pairs = [pair for view, g, offset in zip(self.views, grads, self.offsets)
                     for pair in self.own.pieces_outside(view, g, offset)]  # every number but the own part's
            into, sources = [v for v, _ in pairs], [g for _, g in pairs]
            if scale == 1.0:
                torch._foreach_copy_(into, sources)
            else:
                for out, g in zip(into, sources):
                    torch.mul(g, scale, out=out)
        elif scale == 0.0 or not present:  # an empty batch may leave NaN grads: weight 0 means zero
            region.zero_()
        elif self.copies_back or scale == 1.0 or any(g.dtype != region.dtype for _, g in present):
            # a gradient of another dtype (float16 / bfloat16 in a float32 bucket, or of a parameter gathered in
            # its compute dtype): copied into the bucket's dtype first, scaled there
            if len(present) < len(grads):
                region.zero_()
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
            if scale != 1.0:
                region.mul_(scale)
        else:
            for view, g in zip(self.views, grads):
                if g is None:
                    view.zero_()
                else:
                    torch.mul(g, scale, out=view)
        self.flat[self.count_slot:self.count_slot + len(meta)].copy_(to_device(meta, self.flat), non_blocking=True)
        return self.own

    def total(self) -> float:
        return float(self.flat[self.count_slot])

    def unpack(self, correction: float, copy_back: bool) -> None:
        """Averaged gradients into ``.grad``: as views of the bucket (no copy), or with ``copy_back`` copied
        into autograd's own gradient tensors, as DDP does.

        Copying back after an accumulation window keeps autograd's tensors alive: swapping in views freed
        them at every sync, glibc handed the memory back to the system, and the next window's GEMMs
        page-faulted it in again (10% of a no_sync step on the benchmark MLP). A single backward per sync
        is faster with the views for a large model (one pass over tens of MB fewer: the benchmark MLP's step
        0.97 x DDP's with views, 1.01 with the copy), while for a small one (a ResNet's, a small
        transformer's gradients: a few MB in all) the copy costs nothing and freeing autograd's many small
        tensors changed the heap so that the next forward page-faulted its activations in again
        (ResNet-20: 1.10 x DDP's step with views, 0.97 with the copy): a small model always copies back.
        """
        self.sent = False
        self.ready.clear()
        used = self.flat[self.count_slot + 1:self.count_slot + 1 + len(self.params)].tolist()
        own, self.own = self.own, None
        if correction != 1.0:
            self.flat[:self.count_slot].mul_(correction)
            if own is not None:
                own.correct(correction)
        # own: its sum is in the gradients; widened: the float32 sum is rounded into the parameter's dtype
        copy_back = copy_back or self.copies_back or own is not None or self.widened
        into, sources = [], []  # autograd's gradients and their averages, copied with one batched op
        for p, view, flag, offset in zip(self.params, self.views, used, self.offsets):
            grad = p.grad
            if flag <= 0.0:
                p.grad = None
            elif copy_back and grad is not None and grad is not view and grad.shape == view.shape:
                if own is not None:
                    for piece, grad_piece in own.pieces_outside(view, grad, offset):
                        into.append(grad_piece)
                        sources.append(piece)
                else:
                    into.append(grad)
                    sources.append(view)
            elif grad is not view:
                around = getattr(grad, "around", None)  # a split parameter's gradient stays marked (mp=K)
                summed = view.to(p.dtype) if self.widened else view
                p.grad = summed if around is None else around(summed)
        if into:
            torch._foreach_copy_(into, sources)


def to_device(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A small host list as a tensor for ``like``'s device; pinned, so the copy does not stall a GPU backward."""
    host = torch.tensor(values, dtype=like.dtype)
    return host.pin_memory() if like.device.type == "cuda" else host


def average_(tensors: list[torch.Tensor], weight: float, group: dist.ProcessGroup | None,
             changed: torch.Tensor | None = None) -> None:
    """In place: each tensor becomes sum_r w_r t_r / sum_r w_r over the ranks of ``group``.

    With ``changed`` (one bool per tensor, this rank's; a tensor on their
    device, so that no host sync is needed), a tensor that no rank changed is
    left exactly as it is, not replaced by an average that may round
    differently. A rank of weight 0 contributes nothing, even where it holds inf. Float16 and bfloat16
    tensors are summed in float32 and rounded once (:func:`sum_dtype`).
    """
    by_dtype: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    for (dtype, device), indices in by_dtype.items():
        ts = [tensors[i] for i in indices]
        wide = sum_dtype(dtype)
        data = torch.cat([t.detach().reshape(-1).to(wide) for t in ts])
        data = data.mul_(weight) if weight != 0.0 else data.zero_()
        flags = torch.ones(len(ts), dtype=wide, device=device) if changed is None else \
            changed[torch.tensor(indices, device=changed.device)].to(device=device, dtype=wide)
        flat = torch.cat([data, torch.full((1,), weight, dtype=wide, device=device), flags])
        dist.all_reduce(flat, group=group)
        total, flags = float(flat[data.numel()]), flat[data.numel() + 1:].tolist()
        if total <= 0.0:
            continue  # no rank had any weight: keep what each rank has
        flat.div_(total)
        offset = 0
        with torch.no_grad():
            for t, flag in zip(ts, flags):
                if flag > 0.0:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
