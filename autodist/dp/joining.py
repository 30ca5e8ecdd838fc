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
    found: dict[str, list[torch.optim.Optimizer]] = {}
    schedulers = []
    for obj in gc.get_objects():  # once per admission: nothing the model holds leads to its optimizers
        kind = type(obj)  # (not isinstance: it asks a deprecated torch object for its class, which warns)
        if issubclass(kind, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            if params and all(id(p) in index for p in params):
                found.setdefault(",".join(str(index[id(p)]) for p in params), []).append(obj)
        elif issubclass(kind, lr_scheduler.LRScheduler):
            schedulers.append(obj)
    optimizers = {key: _the_live_one(candidates) for key, candidates in found.items()}
    seen = abandoned.schedulers()
    ordered = seen + [s for s in schedulers if all(s is not t for t in seen)]
    return {key: (o, [s for s in ordered if s.optimizer is o]) for key, o in optimizers.items()}


def _the_live_one(candidates: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """Of the optimizers alive over the same parameters, the one that stepped last (the loop's: an admission
    comes after a step); raises where none has stepped (an old one not freed yet beside a new one)."""
    if len(candidates) == 1:
        return candidates[0]
    stepped = [(step, i) for i, o in enumerate(candidates) if (step := abandoned.last_step(o)) is not None]
    if stepped:
        return candidates[max(stepped)[1]]
    raise RuntimeError(f"{len(candidates)} optimizers over the same parameters of the model are alive "
                       f"({', '.join(type(o).__name__ for o in candidates)}), and none has stepped yet, so a rank "
                       f"joining this elastic job cannot tell which one the training uses: delete the old one "
                       f"(del optimizer) before making its replacement")


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
            saved = pending["schedulers"].get(key, [])
            if len(saved) != len(schedulers):
                raise RuntimeError(f"this rank joined a running elastic job, but its optimizer over parameters {key} "
                                   f"of the model has {len(schedulers)} LR scheduler(s) where the others' has "
                                   f"{len(saved)}: make the same schedulers, in the same order, on every rank")
            for scheduler, state_ in zip(schedulers, saved):
                scheduler.load_state_dict(state_)
