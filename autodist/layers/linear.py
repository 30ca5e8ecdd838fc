"""Linear layers split over the ranks of a model-parallel group, each exact against ``nn.Linear``.

=========================  ==============  ===============  ================  =====================================
layer                      weight split    input            output            collectives (fwd / bwd)
=========================  ==============  ===============  ================  =====================================
``ColumnParallelLinear``   output rows     full             last-dim shard    - / all-reduce (if input grad)
``RowParallelLinear``      input columns   last-dim shard   full              all-reduce / -
``MPBaseLinear``           input columns   full             full              all-reduce / all-gather (if input grad)
``MPInitialLinear``        input columns   full, no grad    full              all-reduce / -
=========================  ==============  ===============  ================  =====================================

"If input grad": only when the input needs a gradient. For the network's first
layer, fed the data, autograd records nothing and backward sends nothing.

A column layer, elementwise ops on its slice, then a row layer is Megatron's
pair: one all-reduce forward, one backward. ``MPBaseLinear`` and
``MPInitialLinear`` are TorchAD-NN's layers done right: full tensor in and
out, so they compose in any ``nn.Sequential``; the bias is added once, after
the all-reduce, and the input gradient is the concatenation of the shards'
gradients (TorchAD-NN summed them and added the bias on every rank).

Widths that do not divide by the group size are split unevenly
(``shard_sizes``). Every layer has the parameters ``weight`` and ``bias`` (this
rank's shards, so state-dict names match ``nn.Linear``'s), ``from_dense`` to
split an existing ``nn.Linear`` and ``dense_state`` to gather it back.
"""
from __future__ import annotations

import weakref
from typing import Any, ClassVar, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from autodist.layers.comm import (copy_to_group, group_rank_size, reduce_from_group_, shard_range, shard_sizes,
                                  split_last_dim)
from autodist.layers.shard import Shard

_Layer = TypeVar("_Layer", bound="_SplitLinear")


def _checked_sizes(layer: str, dim_name: str, n: int, parts: int) -> list[int]:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{layer} expected an int for {dim_name}, got {type(n).__name__} {n!r}")
    if n < parts:
        raise ValueError(f"{layer} cannot split {dim_name}={n} over a group of {parts} ranks: every rank needs "
                         f"at least one; use {dim_name}={parts} (or another multiple of {parts}), "
                         f"a smaller group, or keep this layer an nn.Linear")
    return shard_sizes(n, parts)


def _checked_blocks(layer: str, dim_name: str, n: int, parts: int, blocks: Sequence[int] | None) -> tuple[int, ...]:
    if blocks is None:
        return (n,)
    blocks = tuple(blocks)
    if sum(blocks) != n or any(not isinstance(b, int) or b < parts for b in blocks):
        raise ValueError(f"{layer} got blocks={list(blocks)} for {dim_name}={n} over {parts} ranks: the blocks must "
                         f"add up to {n} and each be at least {parts} wide")
    return blocks


class _GroupHandle:
    """A layer's process group. A copy of the layer shares it: a group is live connections, not data to copy."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> "_GroupHandle":
        return self


class _SplitLinear(nn.Module):
    """What the split Linear layers share: the shard of the dense weight, from_dense, dense_state.

    Attributes: ``in_features``, ``out_features`` (dense sizes), ``group``,
    ``split`` ("column": rows of the dense weight, i.e. output features; "row":
    its columns), ``sizes`` (every rank's width of the split dimension),
    ``rank`` (this rank's index in the group) and ``bounds`` (its ``[lo, hi)``).
    """

    split: ClassVar[str]
    takes_blocks: ClassVar[bool] = True  # False: the input is a full tensor, split evenly here

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 blocks: Sequence[int] | None = None, transposed: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self._group = in_features, out_features, _GroupHandle(group)
        self.transposed = transposed  # the weight is held (in_features, out_features), as HF's Conv1D holds it
        self.rank, parts = group_rank_size(group)
        dim_name = "out_features" if self.split == "column" else "in_features"
        _checked_sizes(type(self).__name__, dim_name, getattr(self, dim_name), parts)
        self.blocks = _checked_blocks(type(self).__name__, dim_name, getattr(self, dim_name), parts, blocks)
        if len(self.blocks) > 1 and not self.takes_blocks:
            raise ValueError(f"{type(self).__name__} splits its full input evenly: it takes no blocks")
        weight_shape = (in_features, out_features) if transposed else (out_features, in_features)
        # the split dimension of the weight: output features for a column split, input features for a row one
        dim = (1 if transposed else 0) if self.split == "column" else (0 if transposed else 1)
        self.shards = {"weight": Shard.even(weight_shape, dim, self.blocks, parts, self.rank, group),
                       "bias": Shard.even((out_features,), 0 if self.split == "column" else None, self.blocks,
                                          parts, self.rank, group)}
        self.sizes = self.shards["weight"].widths()
        self.bounds = shard_range(self.sizes, self.rank)  # meaningful for one block only
        # The whole dense layer is drawn, as nn.Linear would, so that seeding gives the same weights
        # as the single-process model; only this rank's shard is kept.
        dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._take_shard(dense.weight.t() if transposed else dense.weight, dense.bias)

    @classmethod
    def from_dense(cls: type[_Layer], linear: nn.Module, *, group: Any = None, blocks: Sequence[int] | None = None,
                   transposed: bool = False) -> _Layer:
        """This rank's shard of ``linear``: the layer computes exactly what ``linear`` does.

        Args:
            linear: the dense layer, an ``nn.Linear`` or any layer computing ``x @ weight.T + bias`` (or, with
                ``transposed=True``, ``x @ weight + bias``, like Hugging Face's ``Conv1D``); it is not changed.
            group: the process group to split over (None: every rank).
            blocks: the split dimension's blocks, each split on its own (default: one), e.g. ``(C, C, C)`` for
                a fused QKV projection, so that each rank holds its heads of q, k and v.
            transposed: the weight is held ``(in_features, out_features)``; the shard is held the same way.

        Returns:
            The new layer, on ``linear``'s device and dtype, with parameters ``weight`` and ``bias``.

        Example:
            >>> layer = MPBaseLinear.from_dense(nn.Linear(1024, 10), group=mp_group)
        """
        weight = getattr(linear, "weight", None)
        if not isinstance(linear, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"Expect nn.Linear (or a layer with a 2-D weight) for linear, "
                            f"{type(linear).__name__} found")
        bias = getattr(linear, "bias", None)
        in_features, out_features = weight.shape if transposed else weight.shape[::-1]
        with torch.device("meta"):  # no random draws, no dense allocation: the values come from `linear`
            layer = cls(in_features, out_features, bias is not None, group=group, blocks=blocks,
                        transposed=transposed)
        layer._take_shard(weight, bias)
        return layer

    @property
    def group(self) -> Any:
        """The process group the layer is split over (None: the default group, every rank)."""
        return self._group.group

    def _take_shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep this rank's shard of the dense ``weight`` (held as this layer holds it) and ``bias``."""
        self.weight = self.shards["weight"].parameter(weight)
        if bias is None:
            self.register_parameter("bias", None)
            return
        # a row split keeps the whole bias
        self.bias = self.shards["bias"].parameter(bias)

    def _weight(self) -> torch.Tensor:
        """The local weight as F.linear takes it, (out, in)."""
        return self.weight.t() if self.transposed else self.weight

    def dense_state(self, local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The dense ``weight`` and ``bias`` (if any), gathered from every rank of the group; ``local``: this
        rank's values to gather in place of the parameters' (from ``state_dict()``, where the parameters are
        sharded at rest, ``shard="parameters"``).

        Returns:
            ``{"weight": (out_features, in_features), "bias": (out_features,)}``,
            identical on every rank; loads into the dense ``nn.Linear``.

        Example:
            >>> dense.load_state_dict(layer.dense_state())

        Note:
            Communicates: every rank of the group must call it.
        """
        local = local or {}
        return {key: self.shards[key].gather(local.get(key, value))
                for key, value in (("weight", self.weight), ("bias", self.bias)) if value is not None}

    def _check_group(self) -> None:
        now = group_rank_size(self.group)
        if now != (self.rank, len(self.sizes)):
            raise RuntimeError(f"{type(self).__name__} was built as rank {self.rank} of a group of {len(self.sizes)} "
                               f"but is now run as rank {now[0]} of {now[1]}; build MP layers after "
                               f"autodist.init(), in the process that runs them")

    def _check_width(self, x: torch.Tensor, width: int, what: str) -> None:
        if x.ndim == 0 or x.shape[-1] != width:
            raise ValueError(f"{type(self).__name__} expected {what} (last dimension {width}), "
                             f"got shape {tuple(x.shape)}")

    def _row_output(self, x_local: torch.Tensor) -> torch.Tensor:
        # The bias joins after the sum over ranks: added once, not once per rank.
        out = reduce_from_group_(F.linear(x_local, self._weight()), self.group)  # the product is a temporary
        if self.bias is None:
            return out
        # in place eagerly; out of place in a graph (torch 2.11's dynamo refuses the in-place add on the sum's output)
        return out + self.bias if torch.compiler.is_compiling() else out.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, split={self.split}, local_weight={tuple(self.weight.shape)}, "
                + (f"blocks={list(self.blocks)}, " if len(self.blocks) > 1 else "")
                + ("transposed=True, " if self.transposed else "") +
                f"rank={self.rank} of {len(self.sizes)}")


class SharedInput:
    """Column layers that read the same tensor (q, k and v projections) enter the group through one copy,
    so that backward all-reduces the input's gradient once for all of them instead of once per layer.

    Example:
        >>> entry = SharedInput(3)
        >>> for layer in (q_proj, k_proj, v_proj):
        ...     layer.entry = entry
    """

    def __init__(self, users: int) -> None:
        self.users = users
        self._last: tuple[Any, torch.Tensor, int] | None = None  # (weak ref to the input, its copy, uses left)

    def copy(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        last = self._last
        if last is not None and last[0]() is x and last[2] > 0:
            self._last = (last[0], last[1], last[2] - 1)
            return last[1]
        copied = copy_to_group(x, group)
        self._last = (weakref.ref(x), copied, self.users - 1) if self.users > 1 else None
        return copied

    def __deepcopy__(self, memo: dict) -> "SharedInput":
        return SharedInput(self.users)


class ColumnParallelLinear(_SplitLinear):
    """A Linear split by output features: full input in, this rank's last-dim shard of the output out.

    Rank r holds rows ``lo:hi`` of the dense weight (and of the bias). Follow
    it with elementwise ops and a :class:`RowParallelLinear` (Megatron's pair).
    In backward the input's gradient is all-reduced over the group (each rank
    holds only its part of it). When the input needs no gradient - the
    network's first layer, fed the data - autograd records nothing for it, so
    the layer sends nothing at all; an input that does need one (saliency maps,
    adversarial examples) gets the exact gradient.

    Args:
        in_features / out_features / bias: as ``nn.Linear``.
        group: the process group to split over (None: every rank).

    Example:
        >>> up = ColumnParallelLinear(1024, 2048)
        >>> down = RowParallelLinear(2048, 10)
        >>> out = down(torch.tanh(up(x)))      # one all-reduce forward; none backward if x needs no grad

    Note:
        Built directly, the dense weight is drawn as ``nn.Linear`` draws it, then
        sliced: ``torch.manual_seed(s)`` gives the single-process model's weights.
    """

    split = "column"
    entry: SharedInput | None = None  # shared with the other column layers reading the same input, if any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_group()
        self._check_width(x, self.in_features, "the full input")
        x = self.entry.copy(x, self.group) if self.entry is not None else copy_to_group(x, self.group)
        return F.linear(x, self._weight(), self.bias)


class RowParallelLinear(_SplitLinear):
    """A Linear split by input features: this rank's last-dim shard in, the full output out.

    Rank r holds columns ``lo:hi`` of the dense weight; the bias is whole on
    every rank and added once, after the all-reduce of the partial products.

    Args:
        in_features / out_features / bias: as ``nn.Linear``.
        group: the process group to split over (None: every rank).

    Example:
        >>> down = RowParallelLinear(2048, 10)
        >>> out = down(torch.tanh(up(x)))      # up: ColumnParallelLinear(1024, 2048)
    """

    split = "row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_group()
        width = self.sizes[self.rank]
        self._check_width(x, width, f"this rank's shard of the input ({width} of {self.in_features} features; "
                                    f"MPBaseLinear takes the full input)")
        return self._row_output(x)


class MPBaseLinear(_SplitLinear):
    """A Linear split by input features with a full tensor in and out: use it anywhere in a network.

    Forward takes this rank's slice of the input, multiplies by its columns of
    the weight and all-reduces; the bias is added once. Backward all-gathers
    the input gradient: the concatenation of every rank's slice gradient, as
    in one process. An input that needs no gradient (the network's first
    layer) records nothing for autograd, so backward then sends nothing.

    Args:
        in_features / out_features / bias: as ``nn.Linear``.
        group: the process group to split over (None: every rank).

    Example:
        >>> net = nn.Sequential(MPInitialLinear(1024, 2048), MPTanh(), MPBaseLinear(2048, 10))
    """

    split = "row"
    takes_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_group()
        self._check_width(x, self.in_features, "the full input")
        return self._row_output(split_last_dim(x, self.group, self.sizes))


class MPInitialLinear(_SplitLinear):
    """:class:`MPBaseLinear` for the network's first layer: no gradient flows to its input, so no backward
    communication.

    Args:
        in_features / out_features / bias: as ``nn.Linear``.
        group: the process group to split over (None: every rank).

    Example:
        >>> net = nn.Sequential(MPInitialReshape(1024), MPInitialLinear(1024, 2048), MPTanh(),
        ...                     MPBaseLinear(2048, 10))

    Note:
        Raises if its input requires a gradient (the gradient would be this
        rank's slice only): below the top of the network use MPBaseLinear.
    """

    split = "row"
    takes_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_group()
        self._check_width(x, self.in_features, "the full input")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__} is for the first layer of a network, whose input needs no "
                               f"gradient, but its input requires one (it would get only this rank's slice of it); "
                               f"use MPBaseLinear below the top of the network")
        lo, hi = self.bounds
        return self._row_output(x[..., lo:hi])
