"""A module of experts placed over an expert group, as its callers see it: each call read
(:func:`autodist.ep.experts.check_call`), exchanged dropless (:func:`autodist.ep.exchange.dispatch`) and run on
this rank's experts by the subclass (:meth:`Exchanged.run`: fused experts' slices in :mod:`~autodist.ep.place`,
expert modules in :mod:`~autodist.ep.modules`); the expert groups holding the same experts sum their gradients
at the end of the backward that reaches a call (``replicas``).

Example:
    >>> class Mine(Exchanged):
    ...     def run(self, call, rows, chosen, weight):          # chosen: global expert numbers
    ...         return self.own(rows, call.selection(chosen, self.total), weight[:, None])
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from autodist.ep import exchange, experts


class Exchanged:
    """What both kinds of placed experts share: ``name``, ``group``, ``total``, ``per``, ``signature``, ``meter``
    and ``replicas`` are set by the subclass."""

    name: str
    group: Any
    total: int
    per: int
    signature: Any
    meter: exchange.Meter
    replicas: Any  # None, or what sums the experts' gradients over their replicas (place.Replicas)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module's call, exchanged (a bound method: a deep copy of the model gets a copy bound to its own)."""
        return self._exchanged(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "Exchanged":
        """A copy for a copy of the model (its module, its experts), on the same expert group."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, value if key == "group" else copy.deepcopy(value, memo))
        return copied

    def run(self, call: experts.Call, rows: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Each received row's weighted output from this rank's experts (``chosen``: global expert numbers)."""
        raise NotImplementedError

    def tied(self) -> list[torch.Tensor]:
        """The parameters here one process gives a gradient from every backward through the call (see
        :func:`autodist.ep.exchange.dispatch`); none by default (experts held as modules)."""
        return []

    @torch.compiler.disable  # under torch.compile: run eagerly between the graphs (sizes known only from the routing)
    def _exchanged(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = experts.check_call(self.name, self.total, self.signature, args, kwargs)
        out = exchange.dispatch(call.hidden, call.index, call.weights, self.per, self.group, self.meter,
                                lambda rows, chosen, weight: self.run(call, rows, chosen, weight), self.tied())
        if self.replicas is not None:
            self.replicas.watch(out)
        return out
