"""Which modules ``shard="parameters"`` gathers one at a time: the model's *blocks*.

A block's parameters are gathered whole for its forward, freed after it, gathered again for its backward
and freed once its gradients are summed, so a rank holds its 1/N shard of everything plus the few blocks
in use. Found automatically: the members of every ``nn.ModuleList`` / ``nn.Sequential`` whose members with
parameters are all of one type (transformer blocks, ResNet blocks, the Linear layers of an MLP; frozen ones
too, which are gathered the same way and never reduced),
the outermost such container on each path. Chosen by hand with ``blocks=``: a list of module names, or a
callable ``(name, module) -> bool``. What no block holds (embeddings, the final norm, the head) is the
*root*, gathered for the whole forward and backward.

Example:
    >>> [name for name, _ in find(nanogpt)]
    ['transformer.h.0', 'transformer.h.1', ...]
    >>> find(model, ["encoder.layers.0", "encoder.layers.1"])   # by hand
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

from torch import nn

Choice = Union[Sequence[str], Callable[[str, nn.Module], bool], None]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _repeated(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        members = [(f"{prefix}{name}", child) for name, child in module.named_children() if _has_parameters(child)]
        if len(members) >= 2 and len({type(child) for _, child in members}) == 1:
            return members
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        found += _repeated(child, f"{prefix}{name}.")
    return found


def find(model: nn.Module, chosen: Choice = None) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` (qualified name, module), in the model's order: found (``chosen=None``) or the
    modules ``chosen`` names or picks. Raises if one named is missing or one block holds another."""
    if chosen is None:
        return _repeated(model, "")
    if callable(chosen):
        picked = [(name, m) for name, m in model.named_modules() if name and chosen(name, m)]
    elif isinstance(chosen, (list, tuple)) and all(isinstance(n, str) for n in chosen):
        modules = dict(model.named_modules())
        missing = [n for n in chosen if n not in modules or not n]
        if missing:
            raise ValueError(f"blocks names {missing[0]!r}, which is not a submodule of {type(model).__name__} "
                             f"(names as in model.named_modules(), e.g. {next(iter(n for n in modules if n), '')!r})")
        picked = [(name, modules[name]) for name in modules if name in set(chosen)]
    else:
        raise TypeError(f"blocks must be a list of module names or a callable (name, module) -> bool, "
                        f"got {type(chosen).__name__}")
    for outer, _ in picked:
        inner = next((name for name, _ in picked if name.startswith(outer + ".")), None)
        if inner is not None:
            raise ValueError(f"blocks {outer!r} and {inner!r}: one holds the other; name blocks that do not nest")
    return [(name, m) for name, m in picked if _has_parameters(m)]
