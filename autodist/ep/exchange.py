"""The all-to-all that carries tokens to the ranks holding their experts and the experts' outputs back: a
differentiable one (its backward is the all-to-all the other way), with sizes that differ per pair of ranks.

Example:
    >>> received = all_to_all(rows, send=[3, 1], receive=[2, 2], group=group)   # rows: (4, hidden) on this rank
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Meter:
    """Bytes this rank sent to the other ranks of its group: in forwards, and in backwards."""

    def __init__(self, rank: int) -> None:
        self.rank, self.forward, self.backward = rank, 0, 0

    def count(self, rows: torch.Tensor, send: list[int], backward: bool) -> None:
        sent = (sum(send) - send[self.rank]) * (rows[0].numel() if len(rows) else 0) * rows.element_size()
        if backward:
            self.backward += sent
        else:
            self.forward += sent


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any,
                meter: Meter | None) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group, ctx.meter = send, receive, group, meter
        return _exchange(rows, send, receive, group, meter, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group, ctx.meter, True), None, None, None, None


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], group: Any, meter: Meter | None,
              backward: bool) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
    if meter is not None:
        meter.count(rows, send, backward)
    return out


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group: Any,
               meter: Meter | None = None) -> torch.Tensor:
    """``rows`` cut in ``send[r]`` rows for each rank ``r`` of ``group`` (in order), and what the ranks sent this one:
    ``receive[r]`` rows from each, in rank order; gradients flow back the other way. ``meter``: counts the bytes
    this rank sends to the others, forward and backward."""
    if rows.requires_grad:
        return _AllToAll.apply(rows, send, receive, group, meter)
    return _exchange(rows, send, receive, group, meter, False)


def counts(send: torch.Tensor, group: Any) -> list[int]:
    """How many rows each rank of ``group`` will send this one, given ``send`` (rows this one sends each)."""
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send.contiguous(), group=group)
    return receive.tolist()
