"""Noticing a model that gained parameters after ``parallelize``: a head added, a weight replaced.

``parallelize`` fixes what it synchronizes from the model as it is then: the
gradient buckets, the tensors the low-communication modes average. A parameter
registered later would train on each rank alone, and the replicas would drift
apart without a word. torch calls global hooks on every ``register_parameter``,
``register_buffer`` and ``add_module`` in the process (assigning a module or a
parameter as an attribute goes through them too); here they bump one counter,
and a parallelized model walks its parameters again only when the counter moved
since it last looked: an int comparison per forward or step otherwise.

Neither the counter's bump nor its reading is ever traced by ``torch.compile``:
a global that the graph read would become a guard, and a model that makes a
module in its forward (Hugging Face's ``self.layers[:n]``, a new ModuleList at
every call) would bump it and recompile at every step until dynamo gives up. A
compiled forward is checked where autodist's own code runs eagerly (the sync).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

_generation = 0
_handles: list[Any] = []


def _bump(*args: Any) -> None:
    global _generation
    if not torch.compiler.is_compiling():  # a registration in a traced forward: a module made there (a slice)
        _generation += 1


class ModelChanged(RuntimeError):
    """The model holds parameters that ``parallelize`` never saw."""


class Watch:
    """Raises :class:`ModelChanged` once the model holds a parameter it did not hold when watched.

    Example:
        >>> watch = Watch(model, list(model.parameters()))
        >>> model.add_module("head", nn.Linear(3, 3))
        >>> watch.check()      # raises ModelChanged naming head.weight and head.bias
    """

    def __init__(self, model: nn.Module, params: list[torch.Tensor]) -> None:
        if not _handles:
            _handles.extend([torch_module.register_module_parameter_registration_hook(_bump),
                             torch_module.register_module_buffer_registration_hook(_bump),
                             torch_module.register_module_module_registration_hook(_bump)])
        self.model = weakref.ref(model)
        self.params = list(params)  # held, so that no new tensor can take a known one's id
        self.known = {id(p) for p in self.params}
        self.seen = _generation

    def moved(self) -> bool:
        """Something was registered somewhere since the last check (cheap; :meth:`check` says what). Always
        False inside a forward torch.compile traces."""
        return not torch.compiler.is_compiling() and _generation != self.seen

    def check(self) -> None:
        if _generation == self.seen:
            return
        self.seen = _generation
        model = self.model()
        if model is None:
            return
        new = [name for name, p in model.named_parameters() if id(p) not in self.known]
        if new:
            listed = ", ".join(new[:6]) + (f", ... ({len(new) - 6} more)" if len(new) > 6 else "")
            raise ModelChanged(
                f"the model has parameters that autodist.parallelize never saw ({listed}): they were added or "
                f"replaced after parallelize, so nothing would synchronize them and each rank would train its own "
                f"copy. Finish the model first (add heads, tie or replace weights), then call autodist.parallelize, "
                f"which also starts every rank from rank 0's weights")
