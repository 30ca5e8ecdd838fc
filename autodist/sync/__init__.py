"""sync: the data-parallel strategies, one file each; ``parallelize(..., sync=...)`` chooses one, once.
May import: dp, mp, cp, ep, layers, faults, runtime. Entry points: :func:`choose`, :func:`strategy_of`, the strategy
classes.

* ``"backward"`` / ``"manual"``: :class:`Exact`, the bucketed gradient all-reduce (exact training);
* :class:`LocalSGD`: local steps, weights averaged every H steps;
* :class:`DiLoCo`: local (inner) steps, an outer Nesterov step on the averaged delta every H steps;
* :class:`Gossip`: each round a replica averages with a few peers on a changing exponential graph;
* :class:`Hierarchical`: exact sync within each host every step, local SGD or DiLoCo between hosts.
* parameter servers, :class:`autodist.Downpour` and :class:`autodist.EASGD` (:mod:`autodist.ps`): asynchronous.

The low-communication modes hook ``optimizer.step()`` of the model's optimizer (:mod:`autodist.sync.stepping`),
so the user's loop stays as it is. Each says in its docstring what it promises instead of exactness.
"""
from __future__ import annotations

import weakref

from torch import nn

from autodist.sync.base import Strategy, SyncContext
from autodist.sync.diloco import DiLoCo
from autodist.sync.exact import Exact
from autodist.sync.gossip import Gossip
from autodist.sync.hierarchical import Hierarchical
from autodist.sync.local_sgd import LocalSGD

__all__ = ["Strategy", "SyncContext", "Exact", "LocalSGD", "DiLoCo", "Gossip", "Hierarchical", "choose",
           "strategy_of"]

_bound: "weakref.WeakKeyDictionary[nn.Module, Strategy]" = weakref.WeakKeyDictionary()


def choose(sync: object) -> Strategy:
    """The strategy ``sync`` names: "backward", "manual", or a strategy object (returned as it is)."""
    if isinstance(sync, Strategy):
        return sync
    if sync == "backward" or sync == "manual":
        return Exact(hooks=sync == "backward")
    raise ValueError(f"sync must be 'backward' (synchronize during backward), 'manual' (call "
                     f"autodist.synchronize_model yourself) or a strategy such as autodist.LocalSGD(every=16), "
                     f"autodist.DiLoCo(), autodist.Gossip(), autodist.Downpour() or autodist.EASGD(); got {sync!r}")


def setup(strategy: Strategy, model: nn.Module, ctx: SyncContext) -> object | None:
    """Bind ``strategy`` to ``model`` (the model keeps it alive) and return the exact-sync state, if any."""
    exact = strategy.setup(model, ctx)
    _bound[model] = strategy
    return exact


def strategy_of(model: nn.Module) -> Strategy | None:
    """The strategy ``parallelize`` set up for ``model`` (None: not parallelized, or a world of one)."""
    return _bound.get(model)
