"""The step a lost rank abandoned (elastic mode): its ``optimizer.step()`` and LR scheduler step do nothing.

When a sync is abandoned (:mod:`autodist.faults.elastic`), backward returns with every gradient ``None`` and the
loop's iteration goes on as written: its ``optimizer.step()`` then finds no gradient (torch's optimizers skip a
parameter without one, so SGD's momentum and Adam's step count stay as they were), and from here until the
next sync every rank applies, an LR scheduler of that optimizer does not move either (``LRScheduler.step`` and
the ``step`` of torch's schedulers that define their own are wrapped once, in elastic mode only). The loader
then gives the same global batch again, split over the ranks left: the loop sees one more iteration, and the
optimizer and its scheduler see the steps of one process.

Example:
    >>> abandoned.mark()          # a sync was abandoned: this iteration's steps do nothing
    >>> optimizer.step()          # no gradient: skipped; scheduler.step() likewise
    >>> abandoned.committed()     # the next sync every rank applies: steps count again
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.optim import lr_scheduler

from autodist.dp import step_hooks

_pending = False  # a sync was abandoned and no sync was applied since
_skipped: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # stepped while pending
_installed = False  # the listener and the schedulers' wrapped step (once: elastic mode only)
_schedulers: list[weakref.ref] = []  # every LR scheduler, in the order made (its __init__ steps it once)
_dropped: set[int] = set()  # batches (provenance ids) of abandoned iterations: a few per lost rank
_stepped: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()  # -> its last step
_steps = [0]  # the steps seen, for the order of _stepped


class _Listener:
    """Clears the gradients an optimizer steps on while a step is abandoned, and remembers the optimizer."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        _steps[0] += 1
        _stepped[optimizer] = _steps[0]
        if not _pending:
            _skipped.discard(optimizer)
            return
        _skipped.add(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


_listener = _Listener()


def _unless_abandoned(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if all(ref() is not self for ref in _schedulers):
            _schedulers.append(weakref.ref(self))
        if getattr(self, "optimizer", None) in _skipped:
            return None  # its optimizer's step was the abandoned one: the schedule stays where it was
        return step(self, *args, **kwargs)
    return wrapper


def install() -> None:
    """Listen to every optimizer step and wrap the schedulers' ``step`` (once; elastic mode only)."""
    global _installed
    if _installed:
        return
    _installed = True
    step_hooks.listen(_listener)
    for cls in vars(lr_scheduler).values():
        if isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler) and "step" in vars(cls):
            cls.step = _unless_abandoned(cls.step)  # type: ignore[method-assign]


def schedulers() -> list[Any]:
    """The LR schedulers made since :func:`install` and still alive, in the order made."""
    return [s for ref in _schedulers if (s := ref()) is not None]


def last_step(optimizer: torch.optim.Optimizer) -> int | None:
    """When ``optimizer`` last stepped, in the order of every step seen since :func:`install` (None: never)."""
    return _stepped.get(optimizer)


def dropped(batches: Iterable[int]) -> None:
    """The loader takes these batches (provenance ids) again after a regroup: what was counted of them, in the
    abandoned iterations, does not count (``engine.Metrics``)."""
    _dropped.update(batches)


def was_dropped(batch: int) -> bool:
    """Whether the batch (a provenance id) was taken in an abandoned iteration, and taken again since."""
    return batch in _dropped


def mark() -> None:
    """A sync was abandoned: steps do nothing until :func:`committed`."""
    global _pending
    install()
    _pending = True


def committed() -> None:
    """A sync every rank applies: steps count again."""
    global _pending
    _pending = False

