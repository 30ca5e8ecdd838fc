"""The model inside ``torch.compile``'s wrapper: what every function taking a model works on.

``torch.compile(model)`` returns an ``OptimizedModule`` whose state dict names every tensor
``_orig_mod.<name>`` and which no autodist registry knows. Scripts pass it wherever they pass the model
(``autodist.save(path, model, ...)`` with ``model = torch.compile(model)``), so each public function
taking a model unwraps it first: the file names the tensors as the uncompiled model does, the loader
positions saved are the model's, and a compiled run and an uncompiled one read each other's files.

Example:
    >>> unwrapped(torch.compile(model)) is model
    True
"""
from __future__ import annotations

from typing import Any

from torch import nn

PREFIX = "_orig_mod."  # what the wrapper's state dict puts before each name


def unwrapped(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (through any number of wrappers), else ``model`` itself."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model
