"""Each module of experts placed over the ``ep`` ranks of an expert group: rank ``r`` keeps experts ``r E/K`` to
``(r+1) E/K - 1`` (its slice of every ``(E, ...)`` parameter), and every call of the module is run as one
process runs it, dropless:

1. each (token, expert) pair of this rank's tokens, ordered by expert, goes to the rank holding its expert, with
   its token's hidden state and its weight (one all-to-all each, after one of the counts);
2. that rank runs the module's own forward on what it received (its experts, numbered from 0 there), which
   returns each pair's weighted contribution;
3. the contributions come back by the reverse all-to-all and each token's are added to zeros in the order of
   their experts, as one process's loop over the experts adds them (``index_add_`` expert by expert).

Backward runs the same exchanges the other way (autograd: :mod:`~autodist.ep.exchange`). A rank's experts take
gradients from every rank's tokens: the gradient sync's global units (the caller multiplies the model's outputs'
gradients by the sync's factor), so each expert's gradient is its whole expert group's; where several expert groups
hold the same experts (``dp > ep``) those are summed over them at the end of backward (:class:`Replicas`). The expert
parameters are left out of the data-parallel sync.

``model.state_dict()`` holds every expert (the slices gathered over the expert group: a collective, as under
``shard="parameters"``), so checkpoints are whole and load at any world size; ``load_state_dict`` of a whole one
keeps this rank's slice.

Example:
    >>> placed = setup(model, group, rank=1, size=2, replicas=None)   # Mixtral's 8 experts a layer: 4 here
    >>> sorted(placed.params)[:1]                                      # ids of the expert parameters kept here
"""
from __future__ import annotations

import copy
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autodist.ep import exchange, experts
from autodist.layers.shard import Shard
from autodist.runtime.position import waiting


class Placed:
    """One module of experts placed over an expert group: its slice of experts here, and the exchange of each call."""

    def __init__(self, name: str, module: nn.Module, group: Any, rank: int, size: int) -> None:
        self.name, self.group, self.rank, self.size = name, group, rank, size
        self.total = experts.count(module)
        if self.total % size:
            raise ValueError(f"ep={size}: {name} holds {self.total} experts, which do not split evenly over {size} "
                             f"ranks: choose ep from {[k for k in range(2, self.total + 1) if self.total % k == 0]}")
        self.per = self.total // size
        self.names = [n for n, p in module._parameters.items() if p is not None]
        # each parameter's slice of experts: a Shard, which checkpoints gather and cut, and whose gradient's norm
        # clip_grad_norm_ takes over the group (autodist.layers.split_grad)
        self.shards = {n: Shard.even(module._parameters[n].shape, 0, None, size, rank, group) for n in self.names}
        with torch.no_grad():
            for n in self.names:
                setattr(module, n, self.shards[n].parameter(module._parameters[n]))
        module.num_experts = self.per
        self.local = module.forward  # the class's forward, bound: what the experts here run
        self.signature = inspect.signature(self.local)  # how a call's arguments are read, however passed
        module.forward = self.forward  # type: ignore[method-assign]
        self.handles = [module.register_state_dict_post_hook(partial(self._whole_state)),  # torch marks the hook
                        module.register_load_state_dict_pre_hook(self._keep_slice)]
        self.gathering = True  # model.state_dict() gathers every expert (off inside local_state)
        self.meter = exchange.Meter(rank)  # the bytes this rank sent to the others (the benchmark reads them)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module's call, exchanged (a bound method: a deep copy of the model gets a copy bound to its own)."""
        return self._exchanged(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "Placed":
        """A copy for a copy of the model (its module, its slice), on the same expert group."""
        copied = Placed.__new__(Placed)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, value if key == "group" else copy.deepcopy(value, memo))
        return copied

    @torch.compiler.disable  # under torch.compile: run eagerly between the graphs (sizes known only from the routing)
    def _exchanged(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, index, weights = experts.check_call(self.name, self.total, self.signature, args, kwargs)
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # pairs by expert, in token order within one
        token = order // k
        expert = flat[order]
        owner = expert // self.per
        send = torch.bincount(owner, minlength=self.size)
        send_list = send.tolist()
        receive = exchange.counts(send, self.group)
        meter = self.meter
        rows = exchange.all_to_all(hidden[token], send_list, receive, self.group, meter)
        chosen = exchange.all_to_all(expert - owner * self.per, send_list, receive, self.group, meter)
        weight = exchange.all_to_all(weights.reshape(-1)[order], send_list, receive, self.group, meter)
        made = self.local(rows, chosen[:, None], weight[:, None])  # each row: its weight x its expert's output
        back = exchange.all_to_all(made, receive, send_list, self.group, meter)
        return torch.zeros_like(hidden).index_add(0, token, back.to(hidden.dtype))

    # -- state: every expert ------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.local.__self__  # type: ignore[attr-defined]

    def whole(self, name: str) -> torch.Tensor:
        """Every expert's slice of the parameter ``name``, gathered over the expert group (a collective)."""
        with waiting(f"the experts of {self.name} gathered whole (state_dict, copy.deepcopy): a collective, call it "
                     f"on every rank"):
            return self.shards[name].gather(self.module._parameters[name])

    def _whole_state(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        if self.gathering:
            for n in self.names:
                state[prefix + n] = self.whole(n)

    def _keep_slice(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for n in self.names:
            value = state.get(prefix + n)
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == self.total != self.per:
                state[prefix + n] = value[self.rank * self.per:(self.rank + 1) * self.per]


@dataclass
class Replicas:
    """The expert parameters' gradients summed over the expert groups holding the same experts (``dp > ep``), at the
    end of each backward the gradient sync takes part in (``enabled()``: not inside ``no_sync``)."""

    params: list[nn.Parameter]
    group: Any
    enabled: Callable[[], bool]
    queued: bool = False
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.params if p.requires_grad]

    def _arrived(self, _: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sum)

    def _sum(self) -> None:
        self.queued = False
        if not self.enabled():
            return
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


@dataclass
class Placement:
    """What :func:`setup` placed: each module of experts, and the ids of the expert parameters (left out of the
    data-parallel sync)."""

    modules: list[Placed]
    params: frozenset[int]
    replicas: Replicas | None = None

    def __str__(self) -> str:
        first = self.modules[0]
        return (f"the {first.total} experts of {len(self.modules)} layers placed over {first.size} ranks "
                f"({first.per} a rank{', their groups summing each expert' if self.replicas else ''})")


def setup(model: nn.Module, group: Any, rank: int, size: int, replicas: Any,
          enabled: Callable[[], bool] = lambda: True) -> Placement:
    """Place every module of experts of ``model`` over ``group`` (``size`` ranks, this one ``rank``); ``replicas``:
    the group of the ranks holding the same experts in the other expert groups (None: there are none)."""
    found = experts.find(model)
    if not found:
        raise ValueError(f"ep={size} places the experts of mixture-of-experts layers over ranks, and "
                         f"{type(model).__name__} has none: a module holding num_experts experts as (num_experts, "
                         f"...) parameters of its own, called as experts(hidden_states, top_k_index, top_k_weights) "
                         f"(Hugging Face's experts). Leave ep=1")
    placed = [Placed(name, module, group, rank, size) for name, module in found]
    params = [module._parameters[n] for (_, module), p in zip(found, placed) for n in p.names]
    summed = None if replicas is None else Replicas(params, replicas, enabled)
    _placements[model] = placement = Placement(placed, frozenset(id(p) for p in params), summed)
    return placement


@contextmanager
def whole_for_copy(model: nn.Module, memo: dict) -> Iterator[None]:
    """While inside, ``copy.deepcopy(model, memo)`` copies the model as one process holds it: every module of experts
    with all its experts (gathered into ``memo``: a collective) and its own forward."""
    placement = placement_of(model)
    saved = []
    try:
        for placed in [] if placement is None else placement.modules:
            module = placed.module
            for n in placed.names:
                p = module._parameters[n]
                memo[id(p)] = nn.Parameter(placed.whole(n), requires_grad=p.requires_grad)
            saved.append((module, module.__dict__.pop("forward")))
            module.num_experts = placed.total
        yield
    finally:
        for (module, forward), placed in zip(saved, [] if placement is None else placement.modules):
            module.forward = forward  # type: ignore[method-assign]
            module.num_experts = placed.per


@contextmanager
def local_state(model: nn.Module) -> Iterator[None]:
    """While inside, ``model.state_dict()`` holds this rank's experts only (no communication: a checkpoint's
    layout reads the shapes, and each expert parameter's slot says how it is cut)."""
    placed = [] if placement_of(model) is None else placement_of(model).modules  # type: ignore[union-attr]
    for p in placed:
        p.gathering = False
    try:
        yield
    finally:
        for p in placed:
            p.gathering = True


def placement_of(model: nn.Module) -> Placement | None:
    """What :func:`setup` placed of ``model`` (None: it has no expert parallelism)."""
    return _placements.get(model)


_placements: "weakref.WeakKeyDictionary[nn.Module, Placement]" = weakref.WeakKeyDictionary()
