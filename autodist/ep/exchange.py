"""The all-to-all that carries tokens to the ranks holding their experts and the experts' outputs back: a
differentiable one (its backward is the all-to-all the other way), with sizes that differ per pair of ranks.

Example:
    >>> received = all_to_all(rows, send=[3, 1], receive=[2, 2], group=group)   # rows: (4, hidden) on this rank
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

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


class _Joined(torch.autograd.Function):
    """``made`` as it is, its backward reaching what was received (zeros), and ``params`` (zeros): where no received
    row reached one of this rank's experts, the output holds no gradient path, and the exchanges' backward,
    collectives every rank of the group runs, must still run here; experts held as ``(num_experts, ...)``
    parameters (``params``) get the gradient one process gives them, zeros (its loop touched other experts of the
    same tensors: a ``None`` would make the optimizer skip them, no weight decay, no moments: a silently other
    training), while experts held as modules keep ``None``, as one process's idle experts do."""

    @staticmethod
    def forward(ctx: Any, made: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (rows, weight, *params)]
        return made.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


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


def dispatch(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, per: int, group: Any, meter: Meter,
             run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
             tied: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """One call of experts placed ``per`` a rank over ``group``, dropless: this rank's (token, expert) pairs of
    ``index`` (``(tokens, k)``; -1: none), ordered by expert, go to the ranks holding their experts with their
    hidden states and weights; there ``run(rows, experts, weights)`` (one pair a row, the experts by their global
    numbers) returns each pair's weighted output, which comes back and is added to each token's zeros in the order
    of its experts, as one process's loop over the experts adds them. ``tied``: this rank's expert parameters that
    take a gradient from every backward through the call, zeros where no row reached them (fused experts)."""
    k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # pairs by expert, in token order within one
    order = order[flat[order] >= 0]  # a slot that chose no expert (a dropped token) adds nothing
    token = order // k
    expert = flat[order]
    owner = expert // per
    send = torch.bincount(owner, minlength=dist.get_world_size(group))
    send_list = send.tolist()
    receive = counts(send, group)
    rows = all_to_all(hidden[token], send_list, receive, group, meter)
    chosen = all_to_all(expert, send_list, receive, group, meter)
    weight = all_to_all(weights.reshape(-1)[order], send_list, receive, group, meter)
    made = run(rows, chosen, weight)
    tied = [p for p in tied if p.requires_grad]
    if not made.requires_grad and (rows.requires_grad or weight.requires_grad or tied) and torch.is_grad_enabled():
        made = _Joined.apply(made, rows, weight, *tied)  # no row reached an expert here: the others' backward meets
    back = all_to_all(made, receive, send_list, group, meter)
    return torch.zeros_like(hidden).index_add(0, token, back.to(hidden.dtype))


def counts(send: torch.Tensor, group: Any) -> list[int]:
    """How many rows each rank of ``group`` will send this one, given ``send`` (rows this one sends each)."""
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send.contiguous(), group=group)
    return receive.tolist()
