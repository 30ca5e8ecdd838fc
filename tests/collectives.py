"""Counting the collectives a piece of code sends, by wrapping torch.distributed's functions while it runs."""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def counted(run: Callable[[], Any]) -> list[str]:
    """The names of the collectives ``run()`` called, in order.

    Example:
        >>> counted(lambda: model(x).sum().backward())
        ['all_reduce', 'all_reduce']
    """
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in NAMES}

    def counting(name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        run()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return calls
