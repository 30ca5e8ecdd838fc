"""Weighted averages of whole models over a communicator: one all-reduce per dtype."""
from __future__ import annotations

import math

import torch
from torch import nn

from autodist import comm


def float_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors replicas average: every parameter and every floating-point buffer (BatchNorm statistics)."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def weighted_average_(tensors: list[torch.Tensor], weight: float, group: comm.Communicator,
                      error: str | None = None) -> None:
    """In place, each tensor becomes sum_r w_r t_r / sum_r w_r over the ranks of ``group``.

    A rank that could not count its samples sends weight NaN, and every rank
    raises together (``error`` is this rank's reason). When no rank has any
    weight (no counted backward since the last average), the plain mean is taken.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, device), ts in by_kind.items():
            w = 0.0 if weight == 0.0 else weight  # never multiply by NaN below: the slot carries it
            flat = torch.cat([torch.cat([t.reshape(-1) for t in ts]) * (0.0 if math.isnan(w) else w),
                              torch.tensor([w], dtype=dtype, device=device)])
            comm.all_reduce(flat, comm=group)
            total = float(flat[-1])
            if math.isnan(total):
                raise ValueError(error or "autodist cannot count the samples another rank trained on since the last "
                                          "average (see that rank's error), so the replicas cannot be weighted")
            if total > 0:
                flat = flat[:-1].div_(total)
            else:
                flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in ts]), "mean", comm=group)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
