"""Exact sync: today's bucketed gradient all-reduce (:mod:`autodist.dp.grad_sync`), as a strategy."""
from __future__ import annotations

from torch import nn

from autodist.dp.grad_sync import GradSync
from autodist.sync.base import Strategy, SyncContext


class Exact(Strategy):
    """Gradients averaged over the data-parallel ranks at every backward (``hooks=True``, ``sync="backward"``)
    or when the user calls ``autodist.synchronize_model`` (``hooks=False``, ``sync="manual"``).

    Promise: N steps on P ranks give the parameters of N steps in one process on the same global batches.
    """

    def __init__(self, *, hooks: bool = True) -> None:
        super().__init__()
        self.hooks = hooks
        self.name = "backward" if hooks else "manual"

    def _start(self, model: nn.Module, ctx: SyncContext) -> GradSync:
        return GradSync(model, ctx.group, hooks=self.hooks, first_bucket_mb=ctx.first_bucket_mb,
                        bucket_mb=ctx.bucket_mb, sync_buffers=ctx.sync_buffers, counter=ctx.counter,
                        scatter=ctx.scatter, own=ctx.own)

    def __repr__(self) -> str:
        return self.name
