"""One random stream per model-parallel group: its ranks draw the same dropout masks and augmentations."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def share_rng_state(group: Any, src: int, device: torch.device) -> None:
    """Give every rank of ``group`` the torch RNG state of rank ``src``: CPU, and CUDA when ``device`` is a GPU.

    The ranks of a model-parallel group compute one model together, so every
    random op outside the split layers must draw the same numbers on each of
    them: a dropout mask in the replicated region drawn per rank would make
    the replicated parameters' gradients differ, and they would drift apart
    silently. Random data augmentation must agree too, since the ranks of a
    group must see the same input. From here on the ranks stay in step as
    long as they make the same random draws, which they do running the same
    code on the same data. Different model-parallel groups (data-parallel
    replicas) keep their own streams.

    Args:
        group: the model-parallel process group (None: every rank).
        src: the global rank whose state the group takes (its first rank).
        device: the world's device; NCCL groups carry only CUDA tensors, and a
            CUDA device also has its own generator to share.

    Example:
        >>> share_rng_state(groups.mp, src=dims.mp_ranks(rank)[0], device=world.device)
        >>> mask = torch.rand(4) > 0.5    # the same on every rank of the group

    Note:
        Every rank of ``group`` must call it together (it broadcasts).
    """
    torch.set_rng_state(_broadcast(torch.get_rng_state(), group, src, device))
    if device.type == "cuda":
        torch.cuda.set_rng_state(_broadcast(torch.cuda.get_rng_state(device), group, src, device), device)


def _broadcast(state: torch.Tensor, group: Any, src: int, device: torch.device) -> torch.Tensor:
    carried = state.to(device)
    dist.broadcast(carried, src=src, group=group)
    return carried.cpu()
