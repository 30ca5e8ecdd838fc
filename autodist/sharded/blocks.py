"""Which modules ``shard="parameters"`` gathers one at a time: the model's *blocks*.

A block's parameters are gathered whole for its forward, freed after it, gathered again for its backward
and freed once its gradients are summed, so a rank holds its 1/N shard of everything plus the few blocks
in use. Found automatically (:data:`LOOKED_FOR`): in every ``nn.ModuleList`` / ``nn.Sequential``, each run of
two or more consecutive members of one type (counting only the members with parameters, frozen ones too,
which are gathered the same way and never reduced): transformer blocks, ResNet blocks, the Linear layers of
an MLP - also where other members come before or after them (``Sequential(stem, *blocks, pool, head)``) and
at any depth (``model.features``, ``model.encoder.layers``, ``model.transformer.h``), the outermost run on
each path. Members that are plain containers are of one type when their members are; a run of such
containers whose members are blocks themselves (the stages of a ResNet, each a Sequential of blocks) gives
those finer blocks. Chosen by hand with ``blocks=``: a list of module names, or a callable
``(name, module) -> bool``. What no block holds (embeddings, the stem, the final norm, the head) is the
*root*, gathered for the whole forward and backward. ``checkpoint=True`` and ``pp`` take the same blocks.

Example:
    >>> [name for name, _ in find(nanogpt)]
    ['transformer.h.0', 'transformer.h.1', ...]
    >>> [name for name, _ in find(nn.Sequential(stem, *[Block() for _ in range(4)], nn.Flatten(), head))]
    ['1', '2', '3', '4']
    >>> find(model, ["encoder.layers.0", "encoder.layers.1"])   # by hand
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

from torch import nn

Choice = Union[Sequence[str], Callable[[str, nn.Module], bool], None]

LOOKED_FOR = ("runs of two or more consecutive members of one type in a ModuleList or Sequential, at any depth: "
              "transformer layers, ResNet blocks, the layers of an MLP")

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _kind(module: nn.Module) -> Any:
    """What two members must share to be blocks of one run: their type, and for a plain container (the type
    says nothing then) its members' kinds."""
    if type(module) in _CONTAINERS:
        return type(module), tuple(_kind(child) for child in module.children())
    return type(module)


def _finer(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A member of a run: the blocks inside it, where it is a plain container they fill (a ResNet stage of
    blocks), else the member itself."""
    if type(module) in _CONTAINERS:
        inner = _repeated(module, f"{name}.")
        covered = {id(p) for _, m in inner for p in m.parameters()}
        if inner and all(id(p) in covered for p in module.parameters()):
            return inner
    return [(name, module)]


def _repeated(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    if not isinstance(module, _CONTAINERS):
        return [found for name, child in module.named_children() for found in _repeated(child, f"{prefix}{name}.")]
    members = [(f"{prefix}{name}", child) for name, child in module.named_children() if _has_parameters(child)]
    found: list[tuple[str, nn.Module]] = []
    i = 0
    while i < len(members):
        end = i + 1
        while end < len(members) and _kind(members[end][1]) == _kind(members[i][1]):
            end += 1
        if end - i >= 2:
            found += [block for name, child in members[i:end] for block in _finer(name, child)]
        else:
            found += _repeated(members[i][1], f"{members[i][0]}.")
        i = end
    return found


def none_found(model: nn.Module, option: str) -> str:
    """The words for a model in which :func:`find` finds no block: what was looked for, how to name them."""
    names = [name for name, child in model.named_children() if _has_parameters(child)][:3]
    example = ", ".join(repr(n) for n in names) or "'layers.0', 'layers.1'"
    return (f"{option} found no blocks in {type(model).__name__} (it looks for {LOOKED_FOR}); name them with "
            f"parallelize(..., blocks=[...]) as in model.named_modules(), e.g. blocks=[{example}]")


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
