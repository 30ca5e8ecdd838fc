"""Gradients in the global batch's units: where the ranks' backwards exchange gradients with each other (context
parallelism's keys and values, expert parallelism's tokens, BatchNorm's rows through the batch's statistics), each
rank's must carry the gradient of the global loss, so the model's outputs are replaced by views whose gradient is
multiplied by the sync's factor for this backward (``D_r / D``: :meth:`autodist.dp.grad_sync.GradSync.global_units`).

Example:
    >>> output = scaled_outputs(model(x), sync.global_units())   # every output that carries a gradient
    >>> scale_outputs(model, sync.global_units())                # or every forward's, from a hook
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from autodist.runtime.tree import map_tensors


def scaled(tensor: torch.Tensor, scale: Callable[[], float]) -> torch.Tensor:
    """A view of ``tensor`` whose gradient is multiplied by ``scale()`` (asked in backward) before it flows on: a
    view, which the reading of the loss passes through (:mod:`autodist.dp.loss_reading`), and a pre-hook of its
    node, which runs after the sync's hooks on the view itself."""
    view = tensor.view_as(tensor)
    view.grad_fn.register_prehook(lambda grads: tuple(g * scale() if g is not None else g for g in grads))
    return view


def scaled_outputs(output: Any, scale: Callable[[], float]) -> Any:
    """``output`` with every tensor that carries a gradient :func:`scaled`: once per path from the loss, even where
    one output is computed from another inside the model (nanoGPT's loss from its logits)."""
    return map_tensors(output, lambda _, t: scaled(t, scale) if t.requires_grad else t)


def scale_outputs(model: nn.Module, scale: Callable[[], float]) -> RemovableHandle:
    """Every output of ``model``'s forwards that carries a gradient :func:`scaled` by ``scale()``, from a forward
    hook put before the sync's own (which then watches these outputs, so that a backward reaches its hooks, the
    forward's count, before the scale is asked)."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return scaled_outputs(output, scale) if torch.is_grad_enabled() else None
    return model.register_forward_hook(hook, prepend=True)
