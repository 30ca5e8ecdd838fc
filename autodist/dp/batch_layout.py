"""The check that the dimension autodist splits and counts samples along is the one the model batches along.

``parallelize`` splits tensors passed as data along ``batch_dim`` and counts
the samples of forwards along it (0 unless given). Layers that say where their
batch runs can contradict that: a recurrent layer or ``nn.MultiheadAttention``
(and with it ``nn.Transformer``'s layers) with ``batch_first=False`` takes
``(seq, batch, ...)`` inputs. word_language_model keeps its data as one
``(time, batch)`` tensor: split along dimension 0, each rank would train on
every other stretch of time with every column, counting time steps as samples,
and nothing would fail. So, when ``batch_dim`` is left to its default, the
model's first forwards are watched until one runs such a layer: the batch the
first of them sees is compared with the samples autodist counts for that
forward, and a difference raises on every rank, naming ``batch_dim=1``, or
``batch_dim=0`` passed explicitly where the count is right after all.

Example:
    >>> watch(model, SampleCounter(0))    # parallelize does this when batch_dim is left to its default
    >>> model(x)                          # ValueError if an LSTM batches along dimension 1 of x
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.nn.utils.rnn import PackedSequence

from autodist.dp.shares import SampleCounter

_WATCHED_FORWARDS = 8  # forwards watched for a batch-aware layer before the check gives up


def _batch_of(module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(the dimension the layer batches along, its batch size) for a batched input, else None."""
    if isinstance(module, nn.RNNBase):
        x = args[0] if args else kwargs.get("input")
    elif isinstance(module, nn.MultiheadAttention):
        x = args[0] if args else kwargs.get("query")
    else:
        return None
    if isinstance(x, PackedSequence) or getattr(x, "ndim", 0) != 3:
        return None  # packed, or unbatched: no batch dimension to compare
    dim = 0 if module.batch_first else 1
    return dim, int(x.shape[dim])


def _aware(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.RNNBase, nn.MultiheadAttention))]


class _Watch:
    """Hooks on the model and its batch-aware layers, removed once one forward ran such a layer."""

    def __init__(self, model: nn.Module, counter: SampleCounter, layers: list[tuple[str, nn.Module]]) -> None:
        self.counter, self.dim, self.forwards = counter, counter.batch_dim, 0
        self.seen: tuple[str, nn.Module, int, int] | None = None  # the first batch-aware layer of this forward
        self.handles = [model.register_forward_pre_hook(self._begin),
                        model.register_forward_hook(self._end, with_kwargs=True)]
        self.handles += [m.register_forward_pre_hook(self._layer(name), with_kwargs=True) for name, m in layers]

    def _begin(self, module: nn.Module, args: tuple) -> None:
        self.seen = None

    def _layer(self, name: str) -> Any:
        def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found = _batch_of(module, args, kwargs)
            if self.seen is None and found is not None:
                self.seen = (name, module, *found)
        return seen

    def _end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.forwards += 1
        if self.seen is None:
            if self.forwards >= _WATCHED_FORWARDS:
                self.remove()
            return
        self.remove()
        name, layer, dim, batch = self.seen
        counted = self.counter(args, kwargs)
        if math.isnan(counted.count) or counted.count == batch:
            return
        raise ValueError(
            f"autodist counts this forward as {counted.count:g} samples, along dimension {self.dim} of the data "
            f"(batch_dim={self.dim}: parallelize splits tensors passed as data along it, and counts inputs by it), "
            f"but the model's {type(layer).__name__} {name!r} (batch_first={layer.batch_first}) batches along "
            f"dimension {dim} of its input and sees a batch of {batch}. (time, batch) data such as "
            f"word_language_model's must be split along its batch dimension: parallelize(model, data, "
            f"batch_dim={dim}), which gives each rank its columns of every time step. If {counted.count:g} is this "
            f"rank's number of samples after all (the layer's batch is something else), pass batch_dim={self.dim} "
            f"explicitly to say so")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def watch(model: nn.Module, counter: SampleCounter) -> None:
    """Compare, at the first forward of ``model`` that runs a batch-aware layer, the batch that layer sees with
    the samples ``counter`` counts; raise where they differ (see the module docstring). Nothing is watched in a
    model without such layers."""
    layers = _aware(model)
    if layers:
        _Watch(model, counter, layers)
