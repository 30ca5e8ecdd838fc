"""Dropout on a slice that drops exactly what one process drops on the whole tensor."""
from __future__ import annotations

import torch

from autodist.layers.shard import Shard


def dropout_mask(shard: Shard, p: float, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the dropout mask (kept elements ``1 / (1 - p)``, dropped ones 0) that one process
    draws for the dense tensor of shape ``shard.shape``.

    The whole mask is drawn, from the RNG the model-parallel group shares, as
    ``torch.dropout`` draws it for a dense tensor, and this rank keeps its
    slice: the ranks' slices are one process's mask (on CPU, bit for bit), and
    the RNG moves on as in one process, so the ranks stay in step.

    Example:
        >>> shard = Shard.even((8, 4, 10, 10), dim=1, blocks=None, parts=2, rank=1)   # heads 2-3 of 4
        >>> probs = probs * dropout_mask(shard, 0.1, like=probs)
    """
    keep = torch.dropout(torch.ones(shard.shape, dtype=like.dtype, device=like.device), p, True)
    return shard.take(keep)
