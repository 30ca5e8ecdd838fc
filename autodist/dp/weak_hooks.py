"""Hooks on the user's parameters that leave their owner to the garbage collector.

torch keeps a parameter's post-accumulate-grad hooks where the garbage collector does not look (unlike the
hooks of ``Tensor.register_hook``). A hook that is a bound method of an object holding the parameter (the
gradient sync holds every parameter it buckets) makes a cycle the collector cannot see, and the parameter,
the object and everything it holds (buckets, shared memory) outlive the model: every model a sweep or a
notebook ever parallelized would stay in memory. The hook registered here holds its object weakly; the
object lives as long as its model keeps it (the model's own hooks and autodist's registries do).

Example:
    >>> handle = on_grad_accumulated(p, sync._on_grad_ready)   # sync is held weakly
    >>> handle.remove()
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle


def on_grad_accumulated(p: torch.Tensor, method: Callable[[torch.Tensor], Any]) -> RemovableHandle:
    """``p.register_post_accumulate_grad_hook(method)``, ``method``'s object held weakly (a no-op once it is
    gone)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def hook(t: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(t)

    return p.register_post_accumulate_grad_hook(hook)
