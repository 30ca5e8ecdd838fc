"""One pair of process-wide optimizer-step hooks, handed on to whoever listens.

torch calls ``register_optimizer_step_pre_hook`` / ``..._post_hook`` hooks for every ``optimizer.step()``
in the process, and iterates its hook table while calling them, so the table must not change then:
autodist registers one pair once and keeps its own set of listeners (held weakly), each of which decides
whether the optimizer is one of its model's.

Example:
    >>> step_hooks.listen(watch)    # watch.before_step(optimizer) and watch.after_step(optimizer) from now on
"""
from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class Listener(Protocol):
    def before_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def after_step(self, optimizer: torch.optim.Optimizer) -> None: ...


_listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hooks: list[Any] = []


def _before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for listener in list(_listeners):
        listener.before_step(optimizer)


def _after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for listener in list(_listeners):
        listener.after_step(optimizer)


def listen(listener: Listener) -> None:
    """Call ``listener.before_step(optimizer)`` and ``.after_step(optimizer)`` around every step (until it is
    garbage or :func:`forget` is called)."""
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_before))
        _hooks.append(register_optimizer_step_post_hook(_after))
    _listeners.add(listener)


def forget(listener: Listener) -> None:
    _listeners.discard(listener)
