"""The objects whose methods are calling the current function: who is iterating a sampler, who runs a forward.

A frame's ``self`` names the object whose method runs in it. Walking a few frames up from inside a
``__len__``, an ``__iter__`` or a forward hook tells autodist which object drives it (a DistributedSampler
around the dataset ``parallelize`` returned, a DDP wrapper around the model it returned), whatever that
object's authors knew of autodist. Generator frames count: a resumed generator's caller is its ``f_back``.

Example:
    >>> def __len__():                      # of a dataset
    ...     return len(calling_objects())
    >>> class Sampler:
    ...     def count(self):
    ...         return __len__()
    >>> Sampler().count() >= 1              # the Sampler is among the callers of __len__
    True
"""
from __future__ import annotations

import sys
from types import CodeType, FrameType


def calling_objects(limit: int = 24, files: tuple[str, ...] = ()) -> list[object]:
    """The ``self`` of each of the ``limit`` frames above the function calling this one, nearest first; with
    ``files``, only of frames whose code lives in a file whose path contains one of them (cheap: a frame's
    locals are read only then)."""
    return _objects_from(sys._getframe(2), limit, files)


def _objects_from(frame: FrameType | None, limit: int, files: tuple[str, ...]) -> list[object]:
    found: list[object] = []
    for _ in range(limit):
        if frame is None:
            break
        if _is_method_in(frame.f_code, files):
            owner = frame.f_locals.get("self")
            if owner is not None:
                found.append(owner)
        frame = frame.f_back
    return found


_decided: dict[tuple[CodeType, tuple[str, ...]], bool] = {}  # a forward hook walks the same frames every step


def _is_method_in(code: CodeType, files: tuple[str, ...]) -> bool:
    key = (code, files)
    decided = _decided.get(key)
    if decided is None:
        decided = _decided[key] = code.co_varnames[:1] == ("self",) and (
            not files or any(part in code.co_filename.replace("\\", "/") for part in files))
    return decided


def class_named(obj: object, names: tuple[str, ...]) -> str | None:
    """The first class along ``obj``'s class and its bases whose name is one of ``names``, by name, or None (so
    that the classes looked for need not be imported)."""
    for cls in type(obj).__mro__:
        if cls.__name__ in names:
            return cls.__name__
    return None


def calling_class(names: tuple[str, ...], limit: int = 24, files: tuple[str, ...] = ()) -> str | None:
    """:func:`class_named` of the nearest of the objects :func:`calling_objects` finds above the function calling
    this one that has one of ``names``, or None."""
    owners = _objects_from(sys._getframe(2), limit, files)
    return next(filter(None, (class_named(owner, names) for owner in owners)), None)
