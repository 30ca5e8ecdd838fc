"""Watching a model's training without the user's help: its optimizer steps and the samples behind them.

The optimizer is built after ``parallelize`` (model parallelism replaces
parameters), so autodist cannot wrap it. Instead the process-wide optimizer-step
hooks (:mod:`autodist.dp.step_hooks`) see every ``optimizer.step()`` in the
process, and a :class:`StepWatch` passes on those of optimizers holding at least
one of the model's parameters; the answer is remembered per optimizer, so the
filter costs a dictionary look-up per step.

Samples are counted as exact sync counts them (:class:`autodist.dp.shares.SampleCounter`:
from the sharded DataLoader's batch shares, else from the forward's tensors), and only for
forwards a backward goes through: a forward's outputs get a hook that adds its count when a
backward reaches them, once per global batch.
"""
from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from autodist.dp import step_hooks
from autodist.dp.shares import Counted, SampleCounter, watch_outputs
from autodist.dp.structure import Watch
from autodist.dp.weak_hooks import on_grad_accumulated
from autodist.runtime import provenance

class StepWatch:
    """Calls ``on_step()`` after every step of an optimizer holding any of ``model``'s parameters (and
    ``before_step(optimizer)`` before it, if given); lives as long as the strategy owning ``on_step``
    (bound methods, held weakly). Before such a step it refuses parameters added to the model since
    (:class:`autodist.dp.structure.Watch`): the strategy would leave them out."""

    def __init__(self, model: nn.Module, on_step: Callable[[], None],
                 before_step: Callable[[torch.optim.Optimizer], None] | None = None) -> None:
        params = list(model.parameters())
        self.structure = Watch(model, params)
        self.ids = {id(p) for p in params}
        self.mine: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self.on_step = weakref.WeakMethod(on_step)  # type: ignore[arg-type]
        self.on_before = weakref.WeakMethod(before_step) if before_step is not None else None  # type: ignore[arg-type]
        step_hooks.listen(self)
        weakref.finalize(on_step.__self__, step_hooks.forget, self)  # type: ignore[attr-defined]

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self.mine.get(optimizer)
        if holds is None:
            holds = self.mine[optimizer] = any(id(p) in self.ids for g in optimizer.param_groups for p in g["params"])
        return holds

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._holds(optimizer):
            return
        self.structure.check()
        callback = self.on_before() if self.on_before is not None else None
        if callback is not None:
            callback(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        callback = self.on_step() if self._holds(optimizer) else None
        if callback is not None:
            callback()

    def remove(self) -> None:
        step_hooks.forget(self)


def _zero_if_stand_in(tally: "weakref.ref[SampleTally]", grad: torch.Tensor) -> torch.Tensor | None:
    """A compiled forward's stand-in row (its rank holds no row of the batch): no output hook zeroed its gradient,
    so each parameter's is zeroed before autograd adds it, as the uncompiled forward's output hook does."""
    owner = tally()
    share = provenance.current() if owner is not None and owner.compiled else None
    return torch.zeros_like(grad) if share is not None and share.count == 0 else None


class SampleTally:
    """The samples this rank trained on since the last :meth:`reset` (the weight of its replica)."""

    def __init__(self, model: nn.Module, counter: SampleCounter) -> None:
        self.counter = counter
        self.compiled = False  # a forward of the model was traced by torch.compile: count in backward instead
        self.reset()
        self.handle = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self.grad_handles = [on_grad_accumulated(p, self._on_grad) for p in model.parameters() if p.requires_grad]
        zero = partial(_zero_if_stand_in, weakref.ref(self))  # holds the tally weakly, as on_grad_accumulated
        self.grad_handles += [p.register_hook(zero) for p in model.parameters() if p.requires_grad]

    def reset(self) -> None:
        self.count = 0.0
        self.error: str | None = None
        self.seen: set[Any] = set()
        self.kept: list[Counted] = []  # alive until reset, so that ids stay unique

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if torch.compiler.is_compiling():  # the count reads Python state dynamo cannot trace: see _on_grad
            self.compiled = True
            return
        watch_outputs(output, lambda: self.counter(args, kwargs), self._reached)

    def _on_grad(self, p: torch.Tensor) -> None:
        """A compiled forward counted nothing: a gradient's arrival counts the sharded DataLoader's current
        batch (once per batch), or says why it cannot."""
        if not self.compiled:
            return
        share = provenance.current()
        if share is None:
            self._reached(Counted(math.nan, error="the model's forward runs compiled (torch.compile), where "
                                  "autodist cannot count its samples, and no batch of the DataLoader parallelize "
                                  "returned is current: train from that DataLoader"), p)
        else:
            self._reached(self.counter.of_share(share), p)

    def _reached(self, counted: Counted, grad: torch.Tensor) -> torch.Tensor | None:
        zero = torch.zeros_like(grad) if counted.stand_in and isinstance(grad, torch.Tensor) else None  # no row: 0
        key = counted.batch if counted.batch is not None else ("forward", id(counted))
        if key in self.seen:
            return zero
        self.seen.add(key)
        self.kept.append(counted)
        self.count += counted.count
        if math.isnan(counted.count):
            self.error = self.error or counted.error
        return zero

    def remove(self) -> None:
        self.handle.remove()
        for handle in self.grad_handles:
            handle.remove()
