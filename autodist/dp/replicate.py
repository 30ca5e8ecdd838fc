"""Make every rank start from rank 0's weights, after checking they hold the same model."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autodist.runtime import plain

_BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024


Entry = tuple[str, str, torch.Tensor]  # (kind, name, tensor)


def model_tensors(model: nn.Module, exclude: set[int] = frozenset()) -> list[Entry]:  # type: ignore[assignment]
    """Every parameter and buffer as (kind, name, tensor), in registration order, except ids in ``exclude``."""
    return ([("parameter", n, p) for n, p in model.named_parameters() if id(p) not in exclude]
            + [("buffer", n, b) for n, b in model.named_buffers() if id(b) not in exclude])


def signature(entries: list[Entry]) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """(kind, name, shape, dtype, requires_grad) of each entry: what must agree across ranks.

    ``requires_grad`` matters too: a parameter frozen on one rank only would
    leave the ranks' gradient buckets different.
    """
    return [(kind, name, tuple(t.shape), str(t.dtype), t.requires_grad) for kind, name, t in entries]


def first_difference(reference: list[tuple], other: list[tuple], rank: int, reference_rank: int = 0) -> str | None:
    """Words for the first entry where rank's signature differs from the reference rank's, or None.

    Example:
        >>> first_difference([("parameter", "w", (2,), "torch.float32", True)],
        ...                  [("parameter", "w", (3,), "torch.float32", True)], rank=1)
        "parameter 'w': shape (2,) on rank 0, (3,) on rank 1"
    """
    for ref, mine in zip(reference, other):
        if ref[:2] != mine[:2]:
            return f"rank {reference_rank} has {ref[0]} {ref[1]!r} where rank {rank} has {mine[0]} {mine[1]!r}"
        if ref != mine:
            what, i = next((w, i) for w, i in (("shape", 2), ("dtype", 3), ("requires_grad", 4)) if ref[i] != mine[i])
            return f"{ref[0]} {ref[1]!r}: {what} {ref[i]} on rank {reference_rank}, {mine[i]} on rank {rank}"
    if len(reference) != len(other):
        longer, who = (reference, reference_rank) if len(reference) > len(other) else (other, rank)
        extra = longer[min(len(reference), len(other))]
        return f"{extra[0]} {extra[1]!r} exists only on rank {who}"
    return None


def check_same_model(entries: list[Entry], group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank, naming the first difference, unless all ranks of ``group`` hold the same tensors."""
    mine = signature(entries)
    gathered = plain.all_gather(mine, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    problems = [first_difference(gathered[0], sig, ranks[i], ranks[0]) for i, sig in enumerate(gathered)]
    why = next((p for p in problems if p is not None), None)
    if why is not None:
        raise ValueError(f"the ranks hold different models: {why}. Every rank must build the same model "
                         f"(same layers, shapes, dtypes and frozen parameters) before autodist.parallelize")


def broadcast_state(entries: list[Entry], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy (global) rank ``src``'s tensors to every rank of ``group``, a few large messages at a time."""
    tensors = [t for _, _, t in entries]
    chunks: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    for t in tensors:
        key, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        chunk_list = chunks.setdefault(key, [[]])
        if filled.get(key, 0) + nbytes > _BROADCAST_CHUNK_BYTES and chunk_list[-1]:
            chunk_list.append([])
            filled[key] = 0
        chunk_list[-1].append(t)
        filled[key] = filled.get(key, 0) + nbytes
    with torch.no_grad():
        for chunk_list in chunks.values():
            for chunk in chunk_list:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                dist.broadcast(flat, src=src, group=group)
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
