"""Averaging the buffers training changes (BatchNorm's running statistics), weighted by samples.

At every gradient sync each floating-point buffer that some rank changed
since the previous sync becomes its sample-weighted average over the ranks;
a buffer no rank changed (a mask, a constant table) stays bit for bit as it
is. Changes are found by content (BatchNorm updates its statistics in place
without bumping the version counter) against a flat snapshot per dtype.

The buffers of the last gradient bucket's dtype and device ride in that
bucket's all-reduce: its count slot already sums the weights, so they add no
collective and no wait (a blocking all-reduce after every backward cost
ResNet-20 4 ms a step). The last bucket starts when every gradient has
arrived, so the forward's updates are all in. Buffers of another dtype or
device take one all-reduce of their own (``average_``) after the gradients.
Used by :mod:`autodist.dp.grad_sync`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp.buckets import average_
from autodist.runtime.position import waiting
from autodist.runtime.held import Held
from autodist.runtime.world import log

Key = tuple[torch.dtype, torch.device]


class BufferSync:
    """The floating-point buffers of one model, their snapshot at the last sync, and how they travel."""

    def __init__(self, model: nn.Module, enabled: bool, keep: bool = False) -> None:
        self.enabled = enabled
        self.keep = keep  # elastic: the snapshot is kept, for restore(), even where nothing is averaged
        self.owners: list[nn.Module] = []
        self.find_owners(model)
        self.carried: Key | None = None  # the dtype/device that rides in the last gradient bucket
        self.carried_sizes: list[int] = []  # its buffers' sizes when the bucket was built
        self.snapshot = _Snapshot(self.buffers())
        self.sent: torch.Tensor | None = None  # the carried buffers as packed this sync; None: they did not ride
        self.warned_late_change = False
        self.counts: list[tuple[torch.Tensor, torch.Tensor]] = []  # elastic: the other buffers at the last sync

    def find_owners(self, model: nn.Module) -> None:
        """Find the modules holding buffers: once, and again when something was registered since
        (:mod:`autodist.dp.structure`). Walking every module at every sync cost a small model's step more than
        its buffers; their tensors are still read at each sync (see buffers())."""
        self.owners = [m for m in model.modules() if m._buffers] if self.enabled or self.keep else []

    def buffers(self) -> list[torch.Tensor]:
        """The floating-point buffers, as ``model.buffers()`` gives them now (``model.to()`` may have replaced
        the tensors since the last sync)."""
        seen: set[int] = set()
        found = []
        for module in self.owners:
            for b in module._buffers.values():
                if b is not None and b.is_floating_point() and id(b) not in seen:
                    seen.add(id(b))
                    found.append(b)
        return found

    def held(self, held: Held) -> None:
        """The snapshot of the buffers at the last sync (and what rode this sync), for ``autodist.memory``."""
        held.add("autodist buffers", self.sent, *self.snapshot.flat.values(), *self.snapshot.segment.values())

    def forget(self) -> None:
        """Count every buffer as changed at the next sync (their state before is unknown)."""
        self.snapshot = _Snapshot([])

    def keep_counts(self) -> None:
        """Record the buffers that are not floating point (BatchNorm's ``num_batches_tracked``) as they are now: the
        state :meth:`restore` goes back to (elastic mode, at each sync every rank applies)."""
        self.counts = [(b, b.clone()) for m in self.owners for b in m._buffers.values()
                       if b is not None and not b.is_floating_point()]

    def restore(self) -> None:
        """Every buffer back to what it was at the last sync: the forward of a step no rank applies (elastic
        mode: a rank was lost) changed them on this rank alone."""
        self.snapshot.put_back(self.buffers())
        with torch.no_grad():
            for b, kept in self.counts:
                b.copy_(kept)

    def carry(self, dtype: torch.dtype, device: torch.device) -> int:
        """Let the buffers of this dtype and device ride in a bucket; the slots they need there (none where
        nothing is averaged)."""
        if not self.enabled:
            return 0
        self.carried = (dtype, device)
        self.carried_sizes = [b.numel() for b in self.buffers() if (b.dtype, b.device) == self.carried]
        return sum(self.carried_sizes) + len(self.carried_sizes)

    def pack(self, region: torch.Tensor, weight: float) -> None:
        """Write weight * the carried buffers, then one changed-flag each, into ``region`` (a bucket's tail)."""
        buffers = self._carried_now()
        if buffers is None:
            region.zero_()  # shapes changed since the buckets were built: average_rest takes them
            return
        data = torch.cat([b.detach().reshape(-1) for b in buffers])
        n = data.numel()
        if weight != 0.0:
            region[:n].copy_(data)  # into the bucket's dtype first (float32 for low precision), then weighted
            region[:n].mul_(weight)
        else:
            region[:n].zero_()
        region[n:].copy_(self.snapshot.changed(self.carried, data, self.carried_sizes))
        self.sent = data

    def unpack(self, region: torch.Tensor, total: float) -> None:
        """After the all-reduce: each flagged buffer becomes its slice of region / total."""
        buffers, sent, self.sent = self._carried_now(), self.sent, None
        if buffers is None or sent is None:
            return
        now = torch.cat([b.detach().reshape(-1) for b in buffers])
        if not self.warned_late_change and not torch.allclose(now, sent, rtol=0.0, atol=0.0, equal_nan=True):
            self.warned_late_change = True
            log.warning("a buffer changed after the last gradient of the backward arrived (a checkpointed "
                        "BatchNorm recomputed with no parameter before it?): that change is replaced by the "
                        "ranks' average of the buffer as the forward left it")
        n = sent.numel()
        if total > 0.0:
            averaged = region[:n].div_(total).split(self.carried_sizes)
            flagged = [(b, v.view_as(b)) for b, v, flag in zip(buffers, averaged, region[n:].tolist()) if flag > 0.0]
            if flagged:
                with torch.no_grad():
                    torch._foreach_copy_(*map(list, zip(*flagged)))
        self.snapshot.take(buffers)

    def average_rest(self, weight: float, group: dist.ProcessGroup | None, rode: bool) -> None:
        """The buffers that did not ride in a bucket (``rode``: the carried ones did): a blocking all-reduce; where
        nothing is averaged (elastic with ``sync_buffers=False``), the snapshot :meth:`restore` goes back to."""
        if not self.enabled:
            if self.keep:
                self.snapshot.take(self.buffers())
            return
        rest = [b for b in self.buffers() if not (rode and (b.dtype, b.device) == self.carried)]
        if rest:
            with waiting("buffers"):
                average_(rest, weight, group, self.snapshot.changed_each(rest))
            self.snapshot.take(rest)

    def _carried_now(self) -> list[torch.Tensor] | None:
        buffers = [b for b in self.buffers() if (b.dtype, b.device) == self.carried]
        if self.carried is None or not buffers or [b.numel() for b in buffers] != self.carried_sizes:
            return None
        return buffers


class _Snapshot:
    """The buffers' contents at the last sync: one flat tensor and the sizes per dtype and device."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.flat: dict[Key, torch.Tensor] = {}
        self.sizes: dict[Key, list[int]] = {}
        self.segment: dict[Key, torch.Tensor] = {}  # per element of flat: the index of its buffer
        self.take(buffers)

    def take(self, buffers: list[torch.Tensor]) -> None:
        """Record these buffers (all of their dtypes and devices) as they are now."""
        for key, group in _by_key(buffers).items():
            self.flat[key] = torch.cat([b.detach().reshape(-1) for b in group])
            sizes = [b.numel() for b in group]
            if self.sizes.get(key) != sizes:  # built once per layout, not at every sync
                self.sizes[key] = sizes
                self.segment[key] = torch.repeat_interleave(torch.arange(len(sizes), device=key[1]),
                                                            torch.tensor(sizes, device=key[1]))

    def put_back(self, buffers: list[torch.Tensor]) -> None:
        """The inverse of :meth:`take`: each buffer of a dtype and device recorded with the same sizes gets its
        recorded contents back."""
        with torch.no_grad():
            for key, group in _by_key(buffers).items():
                if key in self.flat and [b.numel() for b in group] == self.sizes.get(key):
                    for b, kept in zip(group, self.flat[key].split(self.sizes[key])):
                        b.copy_(kept.view_as(b))

    def changed(self, key: Key, data: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """One flag (1.0 or 0.0, ``data``'s dtype) per buffer of ``key`` (flattened into ``data``)."""
        if self.sizes.get(key) != sizes:  # never seen, or replaced by buffers of other shapes: all changed
            return torch.ones(len(sizes), dtype=data.dtype, device=data.device)
        differs = torch.zeros(len(sizes), dtype=data.dtype, device=data.device)
        differs.index_add_(0, self.segment[key], torch.ne(data, self.flat[key]).to(data.dtype))
        return differs.clamp_(max=1.0)

    def changed_each(self, buffers: list[torch.Tensor]) -> torch.Tensor:
        """A bool per buffer, in the order given, on the first buffer's device."""
        by_key: dict[Key, list[int]] = {}
        for i, b in enumerate(buffers):
            by_key.setdefault((b.dtype, b.device), []).append(i)
        flags = torch.zeros(len(buffers), dtype=torch.bool, device=buffers[0].device)
        for key, indices in by_key.items():
            group = [buffers[i] for i in indices]
            data = torch.cat([b.detach().reshape(-1) for b in group])
            mine = self.changed(key, data, [b.numel() for b in group]).bool().to(flags.device)
            flags[torch.tensor(indices, device=flags.device)] = mine
        return flags


def _by_key(buffers: list[torch.Tensor]) -> dict[Key, list[torch.Tensor]]:
    """``buffers`` by dtype and device, each group in the order given."""
    grouped: dict[Key, list[torch.Tensor]] = {}
    for b in buffers:
        grouped.setdefault((b.dtype, b.device), []).append(b)
    return grouped
