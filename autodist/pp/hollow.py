"""What a stand-in returns for a block before the one whose output this stage receives: a tensor with the
output's shape and dtype and no values, whose every use raises.

Only the output of the block just before this stage's first is sent here. The outputs of the blocks before it
exist on earlier stages alone; a model whose own code uses one of them (a hidden state kept for its output, an
encoder's output that a decoder on this stage reads, a residual added around the blocks) would compute with a
value no stage holds, so that use is an error naming the block and the fix, never a wrong number. Its shape,
dtype and device answer, for code that only looks.

Example:
    >>> h = hollow(received, "transformer.h.0")
    >>> h.shape           # as the block's output
    >>> h + 1             # RuntimeError: the output of transformer.h.0 ...
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

_METADATA = {"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout"}
_METHODS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__}


def _allowed(func: Any) -> bool:
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA
    return func in _METHODS


class Hollow(torch.Tensor):
    """A block's output that another stage holds (see the module docstring)."""

    block: str
    stage: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, block: str, stage: int) -> "Hollow":
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        t.block, t.stage = block, stage
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Hollow(the output of {self.block}, held by stage {self.stage})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if _allowed(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        hollow = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Hollow))
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"{name} on the output of {hollow.block}, a block pipeline stage {hollow.stage} runs: the model's own "
            f"code uses it outside the chain of blocks (a hidden state kept for the output, an encoder's output "
            f"read by later blocks, a residual added around the blocks), and only the output of the block just "
            f"before this stage's first reaches this stage. Cut the stages elsewhere with stages=[...] (an "
            f"encoder-decoder's decoder needs the encoder's output: cut inside the encoder, or between the two), "
            f"return no hidden states (output_hidden_states=False), or use pp=1")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on the output of a block another pipeline stage runs (see the error raised "
                           f"where the model's code used it)")


def hollow(value: Any, block: str, stage: int) -> Any:
    """``value`` (the received output's structure) with every tensor a :class:`Hollow` of block ``block``."""
    return pytree.tree_map(lambda t: Hollow(t, block, stage) if isinstance(t, torch.Tensor) else t, value)
