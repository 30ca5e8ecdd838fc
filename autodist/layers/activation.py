"""Elementwise activations, correct on a full tensor and on a last-dim shard alike."""
from __future__ import annotations

from torch import nn


class MPTanh(nn.Tanh):
    """Elementwise ``tanh``, with no communication.

    Elementwise, it gives the same values on a full tensor as on any slice of
    one: that is why the planner may put it between a column-split Linear and a
    row-split Linear, where each rank holds only its slice of the activation.

    Example:
        >>> net = nn.Sequential(MPInitialLinear(1024, 2048), MPTanh(), MPBaseLinear(2048, 10))
    """
