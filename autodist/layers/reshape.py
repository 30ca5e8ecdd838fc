"""TorchAD-NN's Reshape layers: reshape every sample, keeping the batch dimension.

A reshape of a replicated (full) tensor is the same on every rank, so these
layers need no communication and no knowledge of the group: each is exactly
``x.reshape(x.shape[0], *shape)``. The two names exist because TorchAD-NN
networks are written with them: ``MPInitialReshape`` at the top of the network
(its input usually needs no gradient), ``MPBaseReshape`` anywhere below (the
gradient flows back through it unchanged). They behave identically.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _checked_shape(layer: str, shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1) for d in shape):
        raise ValueError(f"{layer} expected the per-sample shape as positive ints (one of them may be -1), "
                         f"e.g. {layer}(1024) or {layer}(32, 32); got {shape!r}")
    if list(shape).count(-1) > 1:
        raise ValueError(f"{layer} accepts at most one -1 in its shape (the size to infer), got {shape!r}")
    return tuple(shape)


class _SampleReshape(nn.Module):
    def __init__(self, *shape: int | Sequence[int]) -> None:
        super().__init__()
        self.shape = _checked_shape(type(self).__name__, shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0:
            raise ValueError(f"{type(self).__name__} expected a batch (the first dimension is kept), got a scalar")
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return ", ".join(str(d) for d in self.shape)


class MPInitialReshape(_SampleReshape):
    """Reshape each sample of the network's input; the batch dimension (the first) is kept.

    Args:
        *shape: the per-sample shape, without the batch dimension; one entry
            may be -1. A single tuple works too.

    Example:
        >>> MPInitialReshape(1024)(torch.zeros(8, 32, 32)).shape
        torch.Size([8, 1024])

    Note:
        No communication: the input is the same on every rank, and so is its
        reshape. Identical to :class:`MPBaseReshape`; the name marks the top of
        a TorchAD-NN network.
    """


class MPBaseReshape(_SampleReshape):
    """Reshape each sample anywhere inside a network; the gradient flows back through it unchanged.

    Args:
        *shape: the per-sample shape, without the batch dimension; one entry
            may be -1. A single tuple works too.

    Example:
        >>> MPBaseReshape(2, -1)(torch.zeros(8, 10)).shape
        torch.Size([8, 2, 5])

    Note:
        No communication: MP layers hand on full tensors, the same on every
        rank, and a reshape of one is the same everywhere too.
    """
