"""Experts held as modules placed over an expert group: a container of ``num_experts`` expert modules of the same
tensors (Switch Transformers' ``ModuleDict`` of experts, a user's module looping over an ``nn.ModuleList``; see
:func:`autodist.ep.experts.members`). Rank ``r`` keeps experts ``r E/K`` to ``(r+1) E/K - 1`` whole; the others
become :class:`Remote` stand-ins under the same names, holding no tensors. Every call is exchanged as the fused
experts' (:func:`autodist.ep.exchange.dispatch`), and the rank holding an expert runs the module's own forward on
the rows sent to its experts, with their selection in the call's own format and their global numbers: the module's
loop then calls this rank's experts only.

``model.state_dict()`` holds every expert, in one process's order (each key stacked over the group's experts and
gathered: a collective); ``load_state_dict`` of a whole one loads this rank's experts and leaves the others' entries
to their ranks; ``copy.deepcopy`` (under :func:`autodist.ep.place.whole_for_copy`) puts every expert back whole.
Each expert's parameters count once in a norm over the group (``clip_grad_norm_``: marked split over it by
:func:`autodist.ep.place.setup`).

Example:
    >>> placed = PlacedModules("encoder.block.1.layer.1.mlp.experts", experts, group, rank=1, size=2)
    >>> type(experts["expert_0"]).__name__, type(experts["expert_3"]).__name__    # 4 experts, 2 a rank
    ('Remote', 'SwitchTransformersDenseActDense')
"""
from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn

from autodist.ep import exchange, experts
from autodist.ep.calls import Exchanged
from autodist.layers.shard import Shard
from autodist.runtime.position import waiting


class Remote(nn.Module):
    """Where an expert held by another rank of the expert group stood: no tensors; the module of experts fills its
    entries of a state dict (gathered) and its entries of a loaded one are its owner's to load."""

    def __init__(self, layer: str, index: int, owner: int) -> None:
        super().__init__()
        self.layer, self.index, self.owner = layer, index, owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"ep: expert {self.index} of {self.layer} is held by rank {self.owner} of this rank's expert group and "
            f"was called here, outside the exchange: the module of experts called an expert its selection did not "
            f"name (are its children in the order of its experts' numbers?). Leave ep=1 for this model")

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Its entries are its owner's: neither loaded nor unexpected here."""

    def extra_repr(self) -> str:
        return f"expert {self.index}, held by rank {self.owner} of the expert group"


class PlacedModules(Exchanged):
    """One container of expert modules placed over an expert group: its experts here, the exchange of each call."""

    def __init__(self, name: str, module: nn.Module, group: Any, rank: int, size: int, per: int) -> None:
        self.name, self.group, self.rank, self.size, self.per = name, group, rank, size, per
        found = experts.members(module)
        self.total = len(found)
        self.paths = [path for path, _ in found]
        self.here = [m for _, m in found[rank * per:(rank + 1) * per]]
        self.keys = list(self.here[0].state_dict())
        # model-parallel layers (mp's, which hold their dense_state); a pipeline's marks on whole ones are not splits
        split = [n or type(m).__name__ for m in self.here for n, sub in m.named_modules()
                 if callable(getattr(sub, "dense_state", None))]
        if split:
            raise NotImplementedError(f"ep={size}: the experts of {name} are already split by model parallelism "
                                      f"({split[0]}): ep places whole expert modules; use mp=1 with ep")
        for index, (path, _) in enumerate(found):
            if index // per != rank:
                _replace(module, path, Remote(name, index, index // per))
        self.parameters_here = [p for m in self.here for p in m.parameters()]  # marked split by place.setup
        self.own = module.forward  # the class's forward, bound: runs this rank's experts on the rows they get
        self.signature = inspect.signature(self.own)
        module.forward = self.forward  # type: ignore[method-assign]
        self.handles = [module.register_state_dict_post_hook(partial(self._whole_state))]  # torch marks the hook
        self.gathering = True  # model.state_dict() gathers every expert (off inside local_state)
        self.meter = exchange.Meter(rank)
        self.replicas: Any = None  # the sum over the expert groups holding the same experts (set by place.setup)

    @property
    def module(self) -> nn.Module:
        return self.own.__self__  # type: ignore[attr-defined]

    def run(self, call: experts.Call, rows: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.own(rows, call.selection(chosen, self.total), weight[:, None])  # global numbers: its loop

    # -- state: every expert ------------------------------------------------------------------------------------
    def whole(self) -> list[dict[str, torch.Tensor]]:
        """Every expert's state dict, in expert order, gathered over the expert group (a collective)."""
        here = [m.state_dict() for m in self.here]
        every: list[dict[str, torch.Tensor]] = [{} for _ in range(self.total)]
        with waiting(f"the experts of {self.name} gathered whole (state_dict, copy.deepcopy): a collective, call it "
                     f"on every rank"):
            for key in self.keys:
                stacked = torch.stack([state[key].detach() for state in here])
                shard = Shard.even((self.total, *stacked.shape[1:]), 0, None, self.size, self.rank, self.group)
                for index, value in enumerate(shard.gather(stacked).unbind(0)):
                    every[index][key] = value.clone()
        return every

    def _whole_state(self, module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        """Every expert's entries in ``state``, where one process's state dict holds them (this module's entries are
        the last ones written: taken out and put back in order)."""
        if not self.gathering:
            return
        every = self.whole()
        starts = tuple(f"{prefix}{path}." for path in self.paths)
        entries = {key: state.pop(key) for key in [k for k in state if k.startswith(prefix)]}
        pending = True
        for key, value in entries.items():
            if key.startswith(starts):
                if pending:
                    self._put(state, prefix, every)
                    pending = False
            else:
                state[key] = value
        if pending:
            self._put(state, prefix, every)

    def _put(self, state: dict, prefix: str, every: list[dict[str, torch.Tensor]]) -> None:
        for path, expert in zip(self.paths, every):
            for key in self.keys:
                state[f"{prefix}{path}.{key}"] = expert[key]

    @contextmanager
    def as_one_process(self, memo: dict) -> Iterator[None]:
        """While inside, ``copy.deepcopy`` of the model (with ``memo``) copies this module with every expert whole
        (gathered: a collective), its own forward and no mark of autodist's on the experts' parameters."""
        every = self.whole()
        template = self.here[0]
        for index, path in enumerate(self.paths):
            expert = _child(self.module, path)
            fresh = {id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                     for p in expert.parameters()}
            memo.update(fresh)
            if isinstance(expert, Remote):
                whole = copy.deepcopy(template, {id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                                                 for p in template.parameters()})
                whole.load_state_dict(every[index])
                memo[id(expert)] = whole
        forward = self.module.__dict__.pop("forward")
        try:
            yield
        finally:
            self.module.forward = forward  # type: ignore[method-assign]


def _child(module: nn.Module, path: str) -> nn.Module:
    for part in path.split(".") if path else []:
        module = module._modules[part]  # type: ignore[assignment]
    return module


def _replace(module: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    _child(module, parent)._modules[name] = new
