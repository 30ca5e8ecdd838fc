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
from types import CodeType


def calling_objects(limit: int = 24, files: tuple[str, ...] = ()) -> list[object]:
    """The ``self`` of each of the ``limit`` frames above the function calling this one, nearest first; with
    ``files``, only of frames whose code lives in a file whose path contains one of them (cheap: a frame's
    locals are read only then)."""
    found: list[object] = []
    frame = sys._getframe(2)
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
