"""Counting the collectives a piece of code sends, by wrapping torch.distributed's functions while it runs.

The MP layers' all-reduce counts once whichever way it goes: through shared memory between the ranks of one
machine (:mod:`autodist.layers.shared_reduce`: two one-number all-reduces around a sum in place, and the
file's making the first time), or as the backend's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from autodist.layers import shared_reduce

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def counted(run: Callable[[], Any]) -> list[str]:
    """The names of the collectives ``run()`` called, in order.

    Example:
        >>> counted(lambda: model(x).sum().backward())
        ['all_reduce', 'all_reduce']
    """
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in NAMES}
    inside = [0]  # in a layer's all-reduce: what it sends is that one all-reduce

    def counting(name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    layer_all_reduce = shared_reduce.all_reduce

    def one_all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls.append("all_reduce")
        inside[0] += 1
        try:
            return layer_all_reduce(*args, **kwargs)
        finally:
            inside[0] -= 1

    for name in originals:
        setattr(dist, name, counting(name))
    shared_reduce.all_reduce = one_all_reduce
    try:
        run()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        shared_reduce.all_reduce = layer_all_reduce
    return calls
