"""What local SGD and DiLoCo share: local steps counted through the optimizer, exact warm-up, a sync every H."""
from __future__ import annotations

from torch import nn

from autodist.grad_sync import GradSync, registration_of
from autodist.sync.averaging import float_state
from autodist.sync.base import Strategy, SyncContext
from autodist.sync.stepping import SampleTally, StepWatch


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Periodic(Strategy):
    """Counts optimizer steps; the first ``warmup`` are exactly synchronized, then every ``every``-th calls
    :meth:`_sync` (weights: the samples each rank trained on since the last sync)."""

    def __init__(self, every: int, warmup: int) -> None:
        super().__init__()
        self.every = _positive("every", every)
        self.warmup = _positive("warmup", warmup, 0)
        self.steps = 0  # optimizer steps since parallelize (or the checkpoint's)
        self.syncs = 0
        self._exact: GradSync | None = None

    def _start(self, model: nn.Module, ctx: SyncContext) -> GradSync | None:
        self.tensors = float_state(model)
        self.tally = SampleTally(model, ctx.counter)
        self.watch = StepWatch(list(model.parameters()), self._after_step)
        if self.warmup > 0:
            self._exact = GradSync(model, ctx.group, hooks=True, first_bucket_mb=ctx.first_bucket_mb,
                                   bucket_mb=ctx.bucket_mb, sync_buffers=ctx.sync_buffers, counter=ctx.counter)
        return self._exact

    def _after_step(self) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            if self.steps == self.warmup:
                self._end_warmup()
            return
        if (self.steps - self.warmup) % self.every == 0:
            before = self._comm.bytes_sent  # type: ignore[union-attr]
            self._sync()
            self._counted(before)
            self.syncs += 1
            self.tally.reset()

    def _end_warmup(self) -> None:
        """From now on replicas step locally: the gradient hooks go, and so does the exact state no_sync uses."""
        if self._exact is not None:
            self._exact.remove()
            self._exact = None
            registration = registration_of(self.model)
            if registration is not None:
                registration.sync = None
        self.tally.reset()
        self._begin_local()

    def _begin_local(self) -> None:
        """Called when the local phase starts (the replicas are identical then)."""

    def _sync(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        self.watch.remove()
        self.tally.remove()
        if self._exact is not None:
            self._exact.remove()
