"""The vocabulary that :class:`~autodist.mp.shard_flow.Flow` and the split rules share: how a tensor is split
(:class:`Split`), the error a rule raises for what a slice cannot compute (:class:`Unsupported`), and what a rule
may ask of the flow it runs in (:class:`FlowView`).

A rule takes ``(flow, func, args, kwargs)`` and returns ``(args, kwargs, split, function)``: the arguments
for the slice, the split of the output (a list for several outputs), and a function to call instead of
``func`` (or None). It raises :class:`Unsupported` for what a slice cannot compute as the model's code asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

Blocks = tuple[int, ...] | None  # full sizes of the blocks along the split dimension (None: not known yet)


class Unsupported(Exception):
    """An op the slice cannot run as the model's code asks."""


@dataclass(frozen=True)
class Split:
    dim: int  # a non-negative dimension index
    blocks: Blocks


class FlowView(Protocol):
    """What a rule reads of the :class:`~autodist.mp.shard_flow.Flow` it runs in (the flow imports the rules)."""

    parts: int  # ranks the split layers are split over
    local: bool  # running on a rank's slice (True) or planning on the whole model (False)
    rank: int
    splits: Mapping[torch.Tensor, Split]  # the split tensors seen so far

    def split_of(self, tensor: Any) -> Split | None: ...

    def decide(self, tensors: list[torch.Tensor], blocks: tuple[int, ...]) -> None: ...

    def cut(self, args: tuple, kwargs: dict, cut: list[tuple[torch.Tensor, int]], split: Split,
            split_in: list[torch.Tensor]) -> tuple[tuple, dict]: ...

    def full_size(self, t: torch.Tensor, split: Split) -> int: ...

    def full_shape(self, t: torch.Tensor, split: Split) -> list[int]: ...

    def local_width(self, blocks: tuple[int, ...]) -> int: ...


def norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def self_split(flow: FlowView, args: tuple) -> tuple[torch.Tensor, Split]:
    t = args[0]
    split = flow.split_of(t)
    if split is None:
        raise Unsupported("reads a split tensor in an argument it cannot follow")
    return t, split
