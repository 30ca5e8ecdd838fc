"""What every data-parallel strategy gets from ``parallelize`` and what it offers back."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autodist.dp.shares import SampleCounter
from autodist.runtime import comm, ending
from autodist.runtime.held import Held


@dataclass(frozen=True)
class SyncContext:
    """The data-parallel layout and options a strategy is set up with (``parallelize`` builds it once)."""

    group: object | None  # the data-parallel process group; None: the whole world
    dp_ranks: tuple[int, ...]  # world ranks of this rank's data-parallel group, in data-parallel order
    dp_rank: int  # this rank's index among them
    counter: SampleCounter
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    sync_buffers: bool = True
    scatter: Any = None  # shard="gradients": the buckets each rank keeps its part of (autodist.sharded.scatter)
    own: frozenset[int] = frozenset()  # ids of parameters each rank holds its own of (ep's experts): not synced here


class Strategy:
    """A way to keep data-parallel replicas together; bound to one model by :meth:`setup`.

    Subclasses set ``name`` and implement ``_start(model, ctx)``, returning the
    exact-sync state (a ``GradSync``) that ``autodist.no_sync`` and
    ``autodist.synchronize_model`` use, or None when gradients are not synced.
    """

    name = "strategy"
    # Entries of state_dict() that mirror the model's tensors: each a dict {the model tensor's name
    # (tensor_names): a tensor of its shape here}. A checkpoint holds them dense (model-parallel shards
    # gathered, keyed by the original model's names); load cuts them to the loading model's layout.
    mirrors: tuple[str, ...] = ()
    # Whether settle() must run at exit even once the model is dropped: a parameter server serves the other
    # ranks until it is closed. Otherwise the strategy goes with its model, and what it left in flight
    # (``self.in_flight``) is waited for at exit.
    settles_dropped = False

    def __init__(self) -> None:
        self._model: weakref.ref | None = None
        self._comm: comm.Communicator | None = None
        self._sent = 0.0
        self.in_flight = ending.InFlight(self)

    def setup(self, model: nn.Module, ctx: SyncContext) -> object | None:
        """Bind to ``model`` (once) and install what the strategy needs."""
        if self._model is not None:
            raise RuntimeError(f"this {type(self).__name__} is already used by another model; pass a new "
                               f"{type(self).__name__}(...) to each parallelize call")
        self._model = weakref.ref(model)
        self._comm = comm.of_group(ctx.group, "data-parallel ranks")
        ending.finish_orphans()  # parallelize's collectives passed: every rank has started what they hold
        exact = self._start(model, ctx)
        if type(self).settle is not Strategy.settle:  # it may have work in flight at the end
            ending.settle_at_exit(self.settle, weakly=not self.settles_dropped)
        return exact

    def settle(self) -> None:
        """At the end of the script, on every rank: wait for (or abandon alike on every rank) the
        communication still in flight, so that no rank leaves while its peers still talk to it."""

    def _start(self, model: nn.Module, ctx: SyncContext) -> object | None:
        raise NotImplementedError

    @property
    def model(self) -> nn.Module:
        model = self._model() if self._model is not None else None
        if model is None:
            raise RuntimeError(f"this {type(self).__name__} is not in use: pass it to autodist.parallelize(model, "
                               f"data, sync=...) first (in a world of one nothing is set up)")
        return model

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank has sent for the strategy so far (ring estimate, see ``autodist.comm``)."""
        return self._sent

    def _counted(self, before: float) -> None:
        assert self._comm is not None
        self._sent += self._comm.bytes_sent - before

    def held(self) -> Held:
        """What the strategy keeps beside the model (copies, messages under way), for ``autodist.memory``; the
        exact sync's buckets are the gradient sync's."""
        return Held()

    def state_dict(self) -> dict[str, Any]:
        """What a restart needs besides the model and its optimizer (``autodist.save`` stores it).

        Per-tensor state goes in the entries named in :attr:`mirrors`, keyed by the model's tensor names
        (:func:`tensor_names`); no other entry may hold tensors (with ``mp > 1`` they could be shards).
        """
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take back :meth:`state_dict`'s result, after the model itself was loaded (``autodist.load`` calls
        it); None: the checkpoint holds no state of this strategy, so it starts afresh from the loaded model.
        The :attr:`mirrors` entries come keyed by this model's tensor names, cut to its layout."""

    def spread(self) -> float:
        """How far the replicas have drifted apart: max over ranks of ||theta_r - mean|| / ||mean||.

        A collective (every data-parallel rank must call it); its traffic is not counted in ``bytes_sent``.
        0.0 right after an exact average; in a world of one, 0.0.
        """
        if self._comm is None or self._comm.size == 1:
            return 0.0
        with torch.no_grad():
            mine = torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])
            mean = comm.all_reduce(mine, "mean", comm=self._comm, inplace=False)
            gap = torch.stack([(mine - mean).norm(), mean.norm()])
            gaps = comm.all_gather(gap, comm=self._comm)
        return max(float(g[0]) / float(g[1]) if float(g[1]) > 0 else math.inf * float(g[0] > 0) for g in gaps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def tensor_names(model: nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """The name of each of ``tensors`` (parameters or buffers of ``model``): its ``model.state_dict()`` key (the
    first one, for a tied tensor), or its ``named_buffers`` name for a non-persistent buffer.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> tensor_names(net, list(net.parameters()))
        ['0.weight', '0.bias']
    """
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(t), name)
    return [names[id(t)] for t in tensors]
