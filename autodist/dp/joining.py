"""A rank joining a running elastic job: the state the first member sends it, and where each part goes.

At a step boundary after a sync that committed with a rank waiting (:meth:`autodist.faults.elastic.Elastic.admit`),
the first member sends, in one blob through the store: the model's state dict; the state of each optimizer over
the model's parameters and of its LR schedulers, each optimizer named by the positions of its parameters in
``model.parameters()`` (so two optimizers cannot be confused); the place of each of the model's loaders; and
torch's global random generator. The joining rank, in ``parallelize``, loads the model and sets its loaders'
places (its first epoch is the members' epoch in progress, from the batch they take next). Its optimizers and
schedulers are made after ``parallelize``: they get their state when its loader starts that first epoch
(:func:`settle`), before the loop's first batch and before anything the loop does at the end of an epoch
that was already over. ``autodist.resume`` there returns the members' epoch instead of reading the file.

Example:
    >>> blob = state(model, loaders)          # the first member
    >>> epoch = receive(blob, model, loaders) # the joining rank: the epoch its loop goes on with
    >>> settle(model)                         # as its loader starts: the optimizers and schedulers
"""
from __future__ import annotations

import gc
import io
from typing import Any

import torch
from torch import nn
from torch.optim import lr_scheduler

from autodist.dp import abandoned

_pending: dict[str, Any] | None = None  # a joining rank: the optimizers' and schedulers' state, until settled


def listen() -> None:
    """Record LR schedulers as they are made (elastic mode, every rank: any may send the state)."""
    abandoned.install()


def _optimizers(model: nn.Module) -> dict[str, tuple[torch.optim.Optimizer, list[Any]]]:
    """The optimizers over ``model``'s parameters, each named by its parameters' positions in the model, with
    its LR schedulers (in the order they were made where autodist saw it; one made before parallelize after)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    optimizers, schedulers = {}, []
    for obj in gc.get_objects():  # once per admission: nothing the model holds leads to its optimizers
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            if params and all(id(p) in index for p in params):
                optimizers[",".join(str(index[id(p)]) for p in params)] = obj
        elif isinstance(obj, lr_scheduler.LRScheduler):
            schedulers.append(obj)
    seen = abandoned.schedulers()
    ordered = seen + [s for s in schedulers if all(s is not t for t in seen)]
    return {key: (o, [s for s in ordered if s.optimizer is o]) for key, o in optimizers.items()}


def state(model: nn.Module, loaders: list[Any]) -> bytes:
    """What a joining rank needs: the model, its optimizers and their schedulers, its loaders' places, the
    global random generator."""
    optimizers = _optimizers(model)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizers": {k: o.state_dict() for k, (o, _) in optimizers.items()},
                "schedulers": {k: [s.state_dict() for s in ss] for k, (_, ss) in optimizers.items()}, "loaders": [loader.position.state() for loader in loaders],
                "rng": torch.get_rng_state()}, buffer)
    return buffer.getvalue()


def receive(blob: bytes, model: nn.Module, loaders: list[Any]) -> int | None:
    """Load what the first member sent; the epoch the loop goes on with (None: no loader)."""
    global _pending
    saved = torch.load(io.BytesIO(blob), weights_only=True)  # data only: nothing received runs as code
    model.load_state_dict(saved["model"])
    for loader, place in zip(loaders, saved["loaders"]):
        loader.position.load(place)
    torch.set_rng_state(saved["rng"])  # the members' draws from here on (their next epoch's order)
    _pending = {"optimizers": saved["optimizers"], "schedulers": saved["schedulers"]}
    return saved["loaders"][0]["epoch"] if saved["loaders"] else None


def settle(model: nn.Module) -> None:
    """On a joining rank, as its loader starts its first epoch: each optimizer over the model, and each of its
    schedulers in the order they were made, takes the state the members' had (a no-op elsewhere)."""
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    mine = _optimizers(model)
    missing = sorted(set(pending["optimizers"]) - set(mine))
    if missing:
        raise RuntimeError(f"this rank joined a running elastic job, but {len(missing)} of the optimizers the others "
                           f"have over the model's parameters has no counterpart here: build the optimizers before "
                           f"the training loop, over the same parameters in the same order, as the script does "
                           f"on every rank")
    for key, (optimizer, schedulers) in mine.items():
        if key in pending["optimizers"]:
            optimizer.load_state_dict(pending["optimizers"][key])
            for scheduler, saved in zip(schedulers, pending["schedulers"].get(key, [])):
                scheduler.load_state_dict(saved)
