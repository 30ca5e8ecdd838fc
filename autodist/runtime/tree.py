"""Walking nested batches and outputs: tensors and other leaves, each with the path that reaches it.

Understood containers: tuples and lists (named tuples by field), mappings
(``dict``, ``collections.UserDict`` such as Hugging Face's ``BatchEncoding``,
``ModelOutput``), dataclasses, and whatever ``torch.utils._pytree`` has
registered. Anything else is a leaf, reported with its path so that an error
can name it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

_MAX_DEPTH = 64


def leaves(obj: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``obj`` with its path, in a fixed order.

    Example:
        >>> [(p, type(v).__name__) for p, v in leaves({"x": torch.zeros(2), "n": [1]}, "batch")]
        [("batch['x']", 'Tensor'), ("batch['n'][0]", 'int')]
    """
    if isinstance(obj, torch.Tensor) or depth > _MAX_DEPTH:
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from leaves(getattr(obj, field.name), f"{path}.{field.name}", depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, value in zip(obj._fields, obj):
            yield from leaves(value, f"{path}.{name}", depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}[{i}]", depth + 1)
    elif type(obj) in pytree.SUPPORTED_NODES:
        children, _ = pytree.tree_flatten(obj, is_leaf=lambda x: x is not obj)  # one level down
        for i, value in enumerate(children):
            yield from leaves(value, f"{path}<{i}>", depth + 1)
    else:
        yield path, obj


def tensor_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``obj`` with their paths."""
    for where, leaf in leaves(obj, path):
        if isinstance(leaf, torch.Tensor):
            yield where, leaf


def arguments(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """The leaves of a call's arguments, with paths such as ``args[0]`` or ``kwargs['input_ids']``."""
    for i, value in enumerate(args):
        yield from leaves(value, f"args[{i}]")
    for key, value in kwargs.items():
        yield from leaves(value, f"kwargs[{key!r}]")


def map_tensors(obj: Any, fn: Callable[[str, torch.Tensor], Any], path: str = "", depth: int = 0) -> Any:
    """``obj`` rebuilt with each tensor ``t`` at path ``p`` replaced by ``fn(p, t)``; the containers :func:`leaves`
    walks (but torch's pytree-only ones) kept as they are around them, every other leaf as it is.

    Example:
        >>> map_tensors({"x": torch.zeros(2), "n": [1]}, lambda p, t: t + 1)
        {'x': tensor([1., 1.]), 'n': [1]}
    """
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, Mapping):  # a dict, Hugging Face's BatchEncoding
        return type(obj)({k: map_tensors(v, fn, f"{path}[{k!r}]", depth + 1) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, f"{path}.{f.name}", depth + 1)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn, f"{path}.{name}", depth + 1) for name, v in zip(obj._fields, obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj))
    return obj


def call(model: Callable[..., Any], example: Any) -> Any:
    """Run ``model`` on an example the way a training loop would: ``model(*t)`` for a tuple of positional
    arguments, ``model(**d)`` for a mapping of keyword ones, ``model(x)`` for anything else (one tensor).

    Example:
        >>> call(gpt, (idx, targets))      # gpt(idx, targets)
    """
    if isinstance(example, tuple):
        return model(*example)
    if isinstance(example, Mapping):
        return model(**example)
    return model(example)
