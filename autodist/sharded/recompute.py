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

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.utils.checkpoint
from torch import nn

from autodist.runtime.world import log
from autodist.sharded import blocks as blocks_mod


class Recompute:
    """A block's forward whose activations are recomputed in backward: the block's instance attribute
    ``forward`` (copied and pickled with its block)."""

    __slots__ = ("block", "again")

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.again: Callable[[], ContextManager] | None = None  # what the forward runs again inside (within())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if torch.is_grad_enabled():
            args, kwargs = _without_a_cache(block, args, kwargs)
        if self.again is not None and torch.compiler.is_compiling():
            _refuse_compiled(block)
        options = {} if self.again is None else {"context_fn": lambda: (contextlib.nullcontext(), self.again())}
        return torch.utils.checkpoint.checkpoint(type(block).forward, block, *args, use_reentrant=False,
                                                 **options, **kwargs)


@torch.compiler.disable
def _refuse_compiled(block: nn.Module) -> None:
    raise NotImplementedError(
        f"checkpoint=True with cp is not built with torch.compile yet ({type(block).__name__} runs compiled, and "
        f"torch's compiled checkpoint cannot run the block again inside context parallelism's routing): run this "
        f"layout uncompiled, or compile it without checkpoint=True")


_said_cache = [False]


def _without_a_cache(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` without an empty key/value cache (Hugging Face's ``past_key_values``, made by the
    model in every forward while ``config.use_cache`` is on; GPT-2 passes it by position): the block's
    recomputation in backward would append its keys and values a second time and attend over both (a shape
    error where an attention mask is given). What Hugging Face's own gradient checkpointing does
    (``use_cache=False`` in training). A cache holding keys already (a prefix) is refused: dropping it would
    change the result."""
    found = {k: v for k, v in kwargs.items() if _is_cache(v)}
    found.update((f"argument {i}", v) for i, v in enumerate(args) if _is_cache(v))
    if not found:
        return args, kwargs
    for name, cache in found.items():
        held = cache.get_seq_length() if callable(getattr(cache, "get_seq_length", None)) else 0
        if held:  # the blocks before it ran without it too: what it holds came before this forward
            raise NotImplementedError(
                f"checkpoint=True recomputes {type(block).__name__} in backward, and its {name} holds {held} "
                f"positions from before this forward (a prefix): recomputing would add them again. Train "
                f"without the cache (use_cache=False) or without checkpoint=True")
    if not _said_cache[0]:
        _said_cache[0] = True
        log.info("checkpoint=True: %s runs without its key/value cache (%s) while gradients are on, as Hugging "
                 "Face's own gradient checkpointing does (use_cache=False in training): recomputed in backward, "
                 "it would add its keys a second time", type(block).__name__, ", ".join(found))
    return (tuple(None if _is_cache(v) else v for v in args),
            {k: (None if k in found else v) for k, v in kwargs.items()})


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (``transformers.Cache`` and its kinds), known by its class's names."""
    return any(c.__name__ == "Cache" and "transformers" in c.__module__ for c in type(value).__mro__)


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


def within(model: nn.Module, again: Callable[[], ContextManager]) -> None:
    """Run each recomputed block's forward, when backward runs it again, inside ``again()`` (context
    parallelism's routing of attention, which its first run had from the model's forward)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if is_recomputing(forward):
            forward.again = again


def recomputed(model: nn.Module) -> list[str]:
    """The names of ``model``'s blocks whose activations are recomputed in backward."""
    return [name for name, m in model.named_modules() if is_recomputing(m.__dict__.get("forward"))]
