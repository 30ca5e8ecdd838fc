"""The dense, single-process state dict of a model whose layers are split over ranks."""
from __future__ import annotations

import torch
from torch import nn

from autodist.mp.rewrite import mp_modules
from autodist.runtime.compiled import unwrapped
from autodist.runtime.world import init


def gather_state_dict(model: nn.Module, *, all_ranks: bool = False) -> dict[str, torch.Tensor] | None:
    """The model's state dict with every model-parallel layer gathered back to its dense weights.

    The names are the original model's, so the result loads into the plain
    single-process model with ``load_state_dict``.

    Args:
        model: a model returned by ``autodist.parallelize`` (or holding hand-placed MP layers).
        all_ranks: return the dict on every rank instead of on rank 0 only.

    Returns:
        The dense state dict (tensors on the CPU) on rank 0, or on every rank with
        ``all_ranks=True``; None elsewhere.

    Example:
        >>> state = autodist.gather_state_dict(model)
        >>> if state is not None:
        ...     plain_model.load_state_dict(state)

    Note:
        Every rank must call it: the shards are gathered with collectives.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    model = unwrapped(model)  # torch.compile's wrapper: the names of the model it compiled
    world = init()
    live = model.state_dict()  # the values on their device (dense per rank even where sharded at rest)
    state = {k: v.detach().cpu().clone() for k, v in live.items()}
    for name, layer in mp_modules(model):
        prefix = f"{name}." if name else ""
        # a layer that replaced an F.linear call knows the names its weights had in the original model
        original = getattr(layer, "dense_names", {})
        own = {k[len(prefix):]: v for k, v in live.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        for key, value in layer.dense_state(own).items():
            state.pop(prefix + key, None)
            state[original.get(key, prefix + key)] = value.detach().cpu().clone()
    return state if all_ranks or world.rank == 0 else None
