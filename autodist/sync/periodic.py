"""What local SGD and DiLoCo share: local steps counted through the optimizer, exact warm-up, a sync every H."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autodist.dp.grad_sync import GradSync, registration_of
from autodist.runtime import comm
from autodist.sync.averaging import Averager, Pending, TwoLevel, float_state
from autodist.sync.base import Strategy, SyncContext
from autodist.sync.stepping import SampleTally, StepWatch


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Periodic(Strategy):
    """Counts optimizer steps; the first ``warmup`` are exactly synchronized, then :meth:`_local_step` sees the
    n-th local step (n = 1, 2, ...) and averages through :attr:`averager` (weights: the samples each rank
    trained on since its last average)."""

    def __init__(self, every: int, warmup: int) -> None:
        super().__init__()
        self.every = _positive("every", every)
        self.warmup = _positive("warmup", warmup, 0)
        self.steps = 0  # optimizer steps since parallelize (or the checkpoint's)
        self.syncs = 0
        self._exact: GradSync | None = None
        self._fresh = False  # the local phase starts at the next step: take what it needs from the model then
        self.averager: Averager | None = None

    def _start(self, model: nn.Module, ctx: SyncContext) -> GradSync | None:
        assert self._comm is not None
        self.averager = self.averager or Averager(self._comm)
        self.tensors = float_state(model)
        self.tally = SampleTally(model, ctx.counter)
        self.watch = StepWatch(model, self._after_step, self._before_step)
        if self.warmup > 0:
            self._exact = GradSync(model, ctx.group, hooks=True, first_bucket_mb=ctx.first_bucket_mb,
                                   bucket_mb=ctx.bucket_mb, sync_buffers=ctx.sync_buffers, counter=ctx.counter)
        else:
            self._fresh = True
        return self._exact

    def start_two_level(self, model: nn.Module, ctx: SyncContext, host: comm.Communicator,
                        across: comm.Communicator) -> None:
        """Set up as the between-hosts mode of :class:`autodist.Hierarchical` (which syncs within hosts)."""
        if self.warmup:
            raise ValueError(f"{self!r} inside Hierarchical: give it no warmup (Hierarchical already synchronizes "
                             f"every step exactly within each host)")
        self.setup(model, ctx)  # binds the model once, like any strategy
        self.averager = TwoLevel(host, across)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._fresh and self.steps >= self.warmup:
            self._fresh = False
            self._begin_local(optimizer)

    def _after_step(self) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            self._sent += self._exact_step_bytes()
            if self.steps == self.warmup:
                self._end_warmup()
            return
        self._local_step(self.steps - self.warmup)

    def _local_step(self, n: int) -> None:
        """After the n-th local step: average every ``every`` steps."""
        if n % self.every == 0:
            self._sending(self._sync)
            self.syncs += 1
            self.tally.reset()

    def _exact_step_bytes(self) -> float:
        """What a warm-up step's exact sync sent: its buckets (gradients, counts, buffers), ring volume."""
        assert self._comm is not None
        if self._exact is None or self._comm.size == 1:
            return 0.0
        return comm.ring_bytes([b.flat for b in self._exact.buckets], self._comm.size)

    def _sending(self, send: Callable[[], Any]) -> Any:
        """Run ``send`` and count the bytes it sent."""
        assert self.averager is not None
        before = self.averager.sent
        result = send()
        self._sent += self.averager.sent - before
        return result

    def _average(self, tensors: list[torch.Tensor], weight: float | None = None) -> Pending:
        """Start the samples-weighted average of ``tensors`` over the replicas (``weight``: this rank's)."""
        assert self.averager is not None
        return self.averager.start(tensors, self.tally.count if weight is None else weight, self.tally.error)

    def _end_warmup(self) -> None:
        """From now on replicas step locally: the gradient hooks go, and so does the exact state no_sync uses."""
        if self._exact is not None:
            self._exact.remove()
            self._exact = None
            registration = registration_of(self.model)
            if registration is not None:
                registration.sync = None
        self.tally.reset()
        self._fresh = True

    def _begin_local(self, optimizer: torch.optim.Optimizer) -> None:
        """Called right before the first local step (the replicas are identical then)."""

    def _sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The step and sync counts (where the run is in its cycle of ``every`` steps)."""
        return {"steps": self.steps, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        if self.steps >= self.warmup and self._exact is not None:
            self._end_warmup()
        self.tally.reset()
        self._fresh = self.steps >= self.warmup

    def remove(self) -> None:
        self.watch.remove()
        self.tally.remove()
        if self._exact is not None:
            self._exact.remove()
