"""Weighted averages of whole models over a communicator, or over hosts and then within each host.

An average is started (:meth:`Averager.start`) and finished later (:meth:`Pending.wait`), so that a
strategy may let it run behind the next steps (streamed DiLoCo); one all-reduce per dtype and device.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from autodist.runtime import comm


def float_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors replicas average: every parameter and every floating-point buffer (BatchNorm statistics)."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def _by_kind(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    kinds: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    return kinds


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


_NO_WEIGHT = ("autodist cannot count the samples another rank trained on since the last average (see that "
              "rank's error), so the replicas cannot be weighted")


class Pending:
    """A weighted average under way; :meth:`wait` gives the averaged tensors (new tensors, inputs untouched)."""

    def __init__(self, tensors: list[torch.Tensor], weight: float, group: comm.Communicator,
                 error: str | None) -> None:
        self.tensors, self.group, self.error = tensors, group, error
        self.kinds = _by_kind(tensors)
        self.flats, self.handles = [], []
        w = 0.0 if weight == 0.0 else weight
        with torch.no_grad():
            for (dtype, device), idx in self.kinds.items():
                flat = torch.cat([torch.cat([tensors[i].detach().reshape(-1) for i in idx]) *
                                  (0.0 if math.isnan(w) else w), torch.tensor([w], dtype=dtype, device=device)])
                self.flats.append(flat)
                self.handles.append(comm.all_reduce(flat, comm=group, async_op=True))
        self._result: list[torch.Tensor] | None = None

    def abandon(self) -> None:
        """Wait for the communication and keep no result (the same on every rank, whatever the counts)."""
        for handle in self.handles:
            handle.wait()

    def wait(self) -> list[torch.Tensor]:
        """Every rank gets sum_r w_r t_r / sum_r w_r; all raise together if a rank could not count (NaN)."""
        if self._result is not None:
            return self._result
        out = [torch.empty_like(t) for t in self.tensors]
        with torch.no_grad():
            for handle, flat, idx in zip(self.handles, self.flats, self.kinds.values()):
                handle.wait()
                total = float(flat[-1])
                if math.isnan(total):
                    raise ValueError(self.error or _NO_WEIGHT)
                if total > 0:
                    averaged = flat[:-1].div_(total)
                else:  # no rank counted a sample since the last average: the plain mean
                    averaged = comm.all_reduce(torch.cat([self.tensors[i].detach().reshape(-1) for i in idx]),
                                               "mean", comm=self.group)
                _unflatten_into(averaged, [out[i] for i in idx])
        self._result = out
        return out


class Done(Pending):
    """An average already finished (the two-level average runs to completion when started)."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        self._result = result
        self.handles = []


class Averager:
    """Averages replicas over one communicator, each weighted by its samples."""

    def __init__(self, group: comm.Communicator) -> None:
        self.group = group

    @property
    def sent(self) -> float:
        """Bytes this rank has sent through the communicators it uses."""
        return self.group.bytes_sent

    def start(self, tensors: list[torch.Tensor], weight: float, error: str | None = None) -> Pending:
        return Pending(tensors, weight, self.group, error)


class TwoLevel(Averager):
    """Averages over hosts with 1/k of the traffic: member i of each host averages the i-th of k chunks across
    hosts (with the host's summed weight), then the members of a host all-gather the chunks.

    Every member of a host must hold the same tensors (exact sync within the host keeps them so);
    after the average they hold the very same result.
    """

    def __init__(self, host: comm.Communicator, across: comm.Communicator) -> None:
        super().__init__(across)
        self.host, self.across = host, across

    @property
    def sent(self) -> float:
        return self.host.bytes_sent + self.across.bytes_sent

    def start(self, tensors: list[torch.Tensor], weight: float, error: str | None = None) -> Pending:
        k, me = self.host.size, self.host.rank
        host_weight = float(comm.all_reduce(torch.tensor([weight], dtype=torch.float64), comm=self.host))
        out = [torch.empty_like(t) for t in tensors]
        with torch.no_grad():
            for idx in _by_kind(tensors).values():
                flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
                chunk = -(-flat.numel() // k)
                padded = torch.cat([flat, flat.new_zeros(chunk * k - flat.numel())])
                mine = Pending([padded[me * chunk:(me + 1) * chunk]], host_weight, self.across, error).wait()[0]
                whole = torch.cat(comm.all_gather(mine, comm=self.host))
                _unflatten_into(whole[:flat.numel()], [out[i] for i in idx])
        return Done(out)


def weighted_average_(tensors: list[torch.Tensor], weight: float, group: comm.Communicator,
                      error: str | None = None) -> None:
    """In place, each tensor becomes sum_r w_r t_r / sum_r w_r over the ranks of ``group``.

    A rank that could not count its samples sends weight NaN, and every rank
    raises together (``error`` is this rank's reason). When no rank has any
    weight (no counted backward since the last average), the plain mean is taken.
    """
    averaged = Pending(tensors, weight, group, error).wait()
    with torch.no_grad():
        for t, a in zip(tensors, averaged):
            t.copy_(a)
