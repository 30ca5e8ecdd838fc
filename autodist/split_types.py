"""The vocabulary of the split rules: how a tensor is split (:class:`Split`), and the error a rule raises for
what a slice cannot compute (:class:`Unsupported`).

A rule takes ``(flow, func, args, kwargs)`` and returns ``(args, kwargs, split, function)``: the arguments
for the slice, the split of the output (a list for several outputs), and a function to call instead of
``func`` (or None). It raises :class:`Unsupported` for what a slice cannot compute as the model's code asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from autodist.shard_flow import Flow

Blocks = tuple[int, ...] | None  # full sizes of the blocks along the split dimension (None: not known yet)


class Unsupported(Exception):
    """An op the slice cannot run as the model's code asks."""


@dataclass(frozen=True)
class Split:
    dim: int  # a non-negative dimension index
    blocks: Blocks


def norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def self_split(flow: Flow, args: tuple) -> tuple[torch.Tensor, Split]:
    t = args[0]
    split = flow.split_of(t)
    if split is None:
        raise Unsupported("reads a split tensor in an argument it cannot follow")
    return t, split
