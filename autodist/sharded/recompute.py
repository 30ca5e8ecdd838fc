"""Activation checkpointing of the model's blocks: ``parallelize(model, data, checkpoint=True)``.

Each block (:func:`autodist.sharded.blocks.find`: the runs of repeated members of the model's ModuleLists
and Sequentials, or the modules ``blocks=`` names) runs its forward under ``torch.utils.checkpoint`` (the
non-reentrant kind): only its inputs are kept, and backward runs its forward again to get what its own
backward needs. Less memory for activations, one more forward of every block per step; the numbers are the
same (the random state of dropout is replayed), so the training stays one process's. Composes with every
``shard=`` level: under ``"parameters"`` a block is gathered for its backward before it runs again.

The block keeps its class: its ``forward`` becomes an attribute of the instance (:class:`Recompute`), which
``copy.deepcopy`` and pickling carry to the copy's own block, and which the copies of a parallelized model
(:mod:`autodist.train.copies`) leave out.

Example:
    >>> model, loader = autodist.parallelize(model, loader, checkpoint=True)
    >>> recomputed(model)
    ['transformer.h.0', 'transformer.h.1']
"""
from __future__ import annotations

from typing import Any

import torch.utils.checkpoint
from torch import nn

from autodist.sharded import blocks as blocks_mod


class Recompute:
    """A block's forward whose activations are recomputed in backward: the block's instance attribute
    ``forward`` (copied and pickled with its block)."""

    __slots__ = ("block",)

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        return torch.utils.checkpoint.checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def is_recomputing(forward: Any) -> bool:
    """Whether ``forward`` (a module's instance attribute) is the checkpointed forward set by :func:`setup`."""
    return isinstance(forward, Recompute)


def setup(model: nn.Module, chosen: blocks_mod.Choice = None) -> list[str]:
    """Recompute each block of ``model`` in backward; the blocks' names. Raises where the model has none."""
    found = blocks_mod.find(model, chosen)
    if not found:
        raise ValueError(f"checkpoint=True recomputes the model's blocks in backward, and "
                         f"{blocks_mod.none_found(model, 'autodist')}")
    for _, module in found:
        module.forward = Recompute(module)
    return [name for name, _ in found]


def recomputed(model: nn.Module) -> list[str]:
    """The names of ``model``'s blocks whose activations are recomputed in backward."""
    return [name for name, m in model.named_modules() if is_recomputing(m.__dict__.get("forward"))]
