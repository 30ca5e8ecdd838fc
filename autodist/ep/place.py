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

import inspect
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autodist.ep import exchange, experts
from autodist.ep.calls import Exchanged
from autodist.ep.modules import PlacedModules
from autodist.layers.shard import Shard
from autodist.layers.split_grad import mark_grad, mark_inside, mark_split
from autodist.runtime.position import waiting


class Placed(Exchanged):
    """One module of experts placed over an expert group: its slice of experts here, and the exchange of each call."""

    def __init__(self, name: str, module: nn.Module, group: Any, rank: int, size: int) -> None:
        self.name, self.group, self.rank, self.size = name, group, rank, size
        self.total = experts.count(module)
        self.per = per_rank(name, self.total, size)
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
        self.parameters_here = [module._parameters[n] for n in self.names]
        self.replicas: Replicas | None = None  # the sum over the expert groups holding the same experts (setup)

    def run(self, call: experts.Call, rows: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        first = self.rank * self.per
        return self.local(rows, call.selection(chosen - first, self.per), weight[:, None])  # numbered from 0 here

    def tied(self) -> list[torch.Tensor]:
        """Every slice here: one process's loop over the experts gives the whole ``(num_experts, ...)`` tensor a
        gradient, zeros for the experts it did not run, so a rank none of whose experts got a row still has one."""
        return self.parameters_here

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

    @contextmanager
    def as_one_process(self, memo: dict) -> Iterator[None]:
        """While inside, ``copy.deepcopy`` of the model (with ``memo``) copies this module with every expert (gathered
        into ``memo``: a collective) and its own forward."""
        module = self.module
        for n in self.names:
            p = module._parameters[n]
            memo[id(p)] = nn.Parameter(self.whole(n), requires_grad=p.requires_grad)
        forward = module.__dict__.pop("forward")
        module.num_experts = self.total
        try:
            yield
        finally:
            module.forward = forward  # type: ignore[method-assign]
            module.num_experts = self.per

    def _keep_slice(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for n in self.names:
            value = state.get(prefix + n)
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == self.total != self.per:
                state[prefix + n] = value[self.rank * self.per:(self.rank + 1) * self.per]


@dataclass
class Replicas:
    """The expert parameters' gradients summed over the expert groups holding the same experts (``dp > ep``), where
    the gradient sync sends (:meth:`finish`: it calls it at the end of each backward it is not held in, so never
    inside ``no_sync`` or between a pipeline's micro-batches, whose backwards are nested in one)."""

    params: list[nn.Parameter]
    group: Any
    may_lack: bool = False  # experts held as modules: one no row reached has no gradient (fused ones always have)
    reached: bool = False  # a backward reached a call of the experts since the last sum
    changed: set[int] = field(default_factory=set)  # indices of the parameters whose gradient grew since then
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(partial(self._arrived, i))
                        for i, p in enumerate(self.params) if p.requires_grad]

    def _arrived(self, index: int, _: Any = None) -> None:
        self.changed.add(index)

    def _reached(self, grad: torch.Tensor) -> None:
        self.reached = True

    def watch(self, output: torch.Tensor) -> None:
        """A backward that reaches ``output`` (a call of placed experts) takes part in the next sum: a rank none of
        whose experts got a row this step too."""
        if output.requires_grad:
            output.register_hook(self._reached)

    def finish(self) -> None:
        """Sum what the gradients gained since the last sum over the replicas (every rank of the group calls this
        at the same point of its loop: the gradient sync's end of backward). A backward that brought the experts
        no gradient (``torch.autograd.grad``) sums nothing again."""
        if not (self.reached or self.changed):
            return
        self.reached = False
        if self.may_lack:
            indices = self._agree_presence()
        else:  # fused experts: every rank's get a gradient from any backward through them, so all agree
            indices = sorted(self.changed)
        self.changed = set()
        for i in indices:
            dist.all_reduce(self.params[i].grad, group=self.group)

    def _agree_presence(self) -> list[int]:
        """An expert held as a module that no row of this group reached has no gradient here, and may have one in
        another group: zeros where any group has one (one process's gradient is the sum), none where none has.
        The indices of the parameters to sum."""
        grew = torch.zeros(len(self.params), device=self.params[0].device)
        grew[list(self.changed)] = 1.0
        dist.all_reduce(grew, op=dist.ReduceOp.MAX, group=self.group)
        indices = [i for i, anywhere in enumerate(grew.tolist()) if anywhere]
        for i in indices:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                mark_grad(p)  # an expert's part of a norm over the group, as the others
        return indices


@dataclass
class Placement:
    """What :func:`setup` placed: each module of experts, and the ids of the expert parameters (left out of the
    data-parallel sync)."""

    modules: list[Placed | PlacedModules]
    params: frozenset[int]
    replicas: Replicas | None = None

    def __str__(self) -> str:
        if not self.modules:
            return "no experts in this pipeline stage's blocks"
        first = self.modules[0]
        return (f"the {first.total} experts of {len(self.modules)} layers placed over {first.size} ranks "
                f"({first.per} a rank{', their groups summing each expert' if self.replicas else ''})")


def setup(model: nn.Module, group: Any, rank: int, size: int, replicas: Any, sharded_grads: bool = False,
          counted: bool = True, stage_params: frozenset[int] | None = None,
          across: tuple[Any] | None = None) -> Placement:
    """Place every module of experts of ``model`` over ``group`` (``size`` ranks, this one ``rank``); ``replicas``:
    the group of the ranks holding the same experts in the other expert groups (None: there are none);
    ``sharded_grads``: the other parameters' gradients will be sharded (``shard="gradients"``), every rank then
    taking part in a norm over them; ``counted``: whether this rank's experts count in a norm over a group across
    the data-parallel ranks (mp's or pp's: on the first model-parallel rank, every rank of which holds the same
    experts), and ``across`` that group (``(group,)``; None: there is none). :func:`require` checked the whole model first: cut into pipeline stages, a rank holds its stage's
    blocks, which may hold no experts (``stage_params``: the ids of the parameters of those blocks)."""
    found = experts.find(model)
    placed = [Placed(name, module, group, rank, size) if experts.fused(module)
              else PlacedModules(name, module, group, rank, size, per_rank(name, experts.count(module), size))
              for name, module in found]
    modules = any(isinstance(one, PlacedModules) for one in placed)
    params = [p for one in placed for p in one.parameters_here]
    ids = frozenset(id(p) for p in params)
    for p in params:  # each expert a part of a norm over the group, its replicas in the other groups counted once
        mark_split(p, group, inside=(replicas, counted, across))
    if sharded_grads:  # every rank takes a norm over the sharded gradients beside the experts the same way
        for p in model.parameters():
            if id(p) not in ids:
                mark_inside(p, replicas)
    elif modules:
        _in_every_norm(model, ids, group, rank, (replicas, counted, across), stage_params)
    summed = None if replicas is None or not params else Replicas(params, replicas, modules)
    for one in placed:
        one.replicas = summed
    _placements[model] = placement = Placement(placed, ids, summed)
    return placement


def require(model: nn.Module, size: int, staged: bool, split: bool = False) -> None:
    """An error unless ``model`` holds a module of experts that ep places in its layout (``staged``: cut into
    pipeline stages, ``split``: by mp; checked on the whole model, before the cut)."""
    found = experts.find(model)
    if not found:
        raise ValueError(f"ep={size} places the experts of mixture-of-experts layers over ranks, and "
                         f"{type(model).__name__} has none: a module holding num_experts experts, as (num_experts, "
                         f"...) parameters of its own or as num_experts modules of the same shapes, called as "
                         f"experts(hidden_states, top_k_index, top_k_weights) (Hugging Face's experts). Leave ep=1")
    held = [name for name, module in found if not experts.fused(module)]
    if staged and split and held:
        raise NotImplementedError(f"ep={size} with pp and mp: experts held as modules ({held[0]}) are not built with "
                                  f"pipeline stages and model parallelism together yet (fused experts are: Hugging "
                                  f"Face's (num_experts, ...) parameters); use two of pp, mp and ep")


def _in_every_norm(model: nn.Module, placed: frozenset[int], group: Any, rank: int, inside: tuple[Any, bool, Any],
                   stage_params: frozenset[int] | None) -> None:
    """Experts held as modules: one that no row reached has no gradient (as in one process, where the optimizer
    then skips it), and a rank none of whose experts got a row would skip a norm over the group (``clip_grad_norm_``)
    the others take. So the other trainable parameters every rank of the group holds alike count in such a norm
    too, once (on the group's first rank), and every rank takes part in it: those mp does not split, or under pp
    this stage's blocks' (the root's keep their sum over the stages). (Under ``shard="gradients"`` every rank
    takes part anyway.)"""
    for p in model.parameters():
        if not p.requires_grad or id(p) in placed:
            continue
        if (id(p) in stage_params) if stage_params is not None else getattr(p, "split_over", None) is None:
            mark_split(p, group, counted=rank == 0, inside=inside)


@contextmanager
def whole_for_copy(model: nn.Module, memo: dict) -> Iterator[None]:
    """While inside, ``copy.deepcopy(model, memo)`` copies the model as one process holds it: every module of experts
    with all its experts (gathered into ``memo``: a collective) and its own forward."""
    placement = placement_of(model)
    with ExitStack() as stack:
        for placed in [] if placement is None else placement.modules:
            stack.enter_context(placed.as_one_process(memo))
        yield


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


def per_rank(name: str, total: int, size: int) -> int:
    """The experts of the layer ``name`` each of ``size`` ranks holds, or an error naming the ``ep`` that divide."""
    if total % size:
        raise ValueError(f"ep={size}: {name} holds {total} experts, which do not split evenly over {size} ranks: "
                         f"choose ep from {[k for k in range(2, total + 1) if total % k == 0]}")
    return total // size


def placement_of(model: nn.Module) -> Placement | None:
    """What :func:`setup` placed of ``model`` (None: it has no expert parallelism)."""
    return _placements.get(model)


_placements: "weakref.WeakKeyDictionary[nn.Module, Placement]" = weakref.WeakKeyDictionary()
