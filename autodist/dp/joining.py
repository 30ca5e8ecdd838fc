"""A rank joining a running elastic job: the state the first member sends it, and where each part goes.

At a step boundary after a sync that committed with a rank waiting (:meth:`autodist.faults.elastic.Elastic.admit`),
the first member sends, in one blob through the store: the model's state dict, the state of each optimizer that
stepped the model's parameters (in the order they first stepped) and of each LR scheduler (in the order they
were made), and the place of each of the model's loaders. The joining rank, in ``parallelize``, loads the model
and sets its loaders' places (its first epoch is the members' epoch in progress, from the batch they take next);
its optimizers and schedulers, made after ``parallelize``, get their state at their first ``optimizer.step()``,
before it runs. ``autodist.resume`` there returns the members' epoch instead of reading the checkpoint file.

Example:
    >>> blob = state(model, loaders)          # the first member
    >>> epoch = receive(blob, model, loaders) # the joining rank: the epoch its loop goes on with
"""
from __future__ import annotations

import io
import weakref
from typing import Any

import torch
from torch import nn

from autodist.dp import abandoned, step_hooks

_optimizers: list[weakref.ref] = []  # every optimizer that stepped, in the order it first did


class _Listener:
    """Records optimizers as they first step; gives a joining rank's optimizers and schedulers their state."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Any]] | None = None

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if all(ref() is not optimizer for ref in _optimizers):
            _optimizers.append(weakref.ref(optimizer))
        if self.pending is not None and self.pending["optimizers"]:
            optimizer.load_state_dict(self.pending["optimizers"].pop(0))
            schedulers = [s for s in abandoned.schedulers() if s.optimizer is optimizer]
            for scheduler, saved in zip(schedulers, self.pending["schedulers"]):
                scheduler.load_state_dict(saved)
            self.pending["schedulers"] = self.pending["schedulers"][len(schedulers):]

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


_listener = _Listener()


def listen() -> None:
    """Record optimizers and schedulers from now on (elastic mode, every rank: any may send the state)."""
    abandoned.install()
    step_hooks.listen(_listener)


def state(model: nn.Module, loaders: list[Any]) -> bytes:
    """What a joining rank needs: the model, its optimizers and their schedulers, its loaders' places."""
    params = {id(p) for p in model.parameters()}
    optimizers = [o for ref in _optimizers if (o := ref()) is not None
                  and any(id(p) in params for g in o.param_groups for p in g["params"])]
    schedulers = [s for s in abandoned.schedulers() if any(s.optimizer is o for o in optimizers)]
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers],
                "loaders": [loader.position.state() for loader in loaders]}, buffer)
    return buffer.getvalue()


def receive(blob: bytes, model: nn.Module, loaders: list[Any]) -> int | None:
    """Load what the first member sent; the epoch the loop goes on with (None: no loader)."""
    saved = torch.load(io.BytesIO(blob), weights_only=True)  # data only: nothing received runs as code
    model.load_state_dict(saved["model"])
    for loader, place in zip(loaders, saved["loaders"]):
        loader.position.load(place)
    _listener.pending = {"optimizers": list(saved["optimizers"]), "schedulers": list(saved["schedulers"])}
    return saved["loaders"][0]["epoch"] if saved["loaders"] else None
