"""Plain data between ranks: numbers, strings, booleans, None, and lists / tuples / dicts of them, sent as
JSON in byte tensors. Nothing a peer sends is unpickled: torch's ``all_gather_object`` and
``broadcast_object_list`` run ``pickle.loads`` on what arrives, so anything able to reach a rank's socket
could run code in it; these cannot. Lists come back as tuples (what autodist sends are tuples).
:func:`all_gather_saved` carries tensors too, in torch.save's format read back with
``torch.load(weights_only=True)``, which builds data only.

Example:
    >>> plain.all_gather(("cpu-host", True), group=None)      # on 2 ranks
    [('cpu-host', True), ('cpu-host', True)]
"""
from __future__ import annotations

import io
import json
from typing import Any

import torch
import torch.distributed as dist


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)  # never empty


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _decode(data: torch.Tensor) -> Any:
    return _tuples(json.loads(bytes(data.cpu().tolist()).decode()))


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in group rank order (a collective over ``group``; None: the whole world)."""
    device = _device(group)
    return [_decode(data) for data in _gather_bytes(_encode(obj, device), group, device)]


def all_gather_saved(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, which may hold tensors too, in group rank order (a collective over ``group``): sent
    in torch.save's format and read back with ``torch.load(weights_only=True)``, which builds data only (tensors on
    the CPU, numbers, strings, lists, dicts)."""
    device = _device(group)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
    return [torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True, map_location="cpu")
            for data in _gather_bytes(mine, group, device)]


def _gather_bytes(mine: torch.Tensor, group: Any, device: torch.device) -> list[torch.Tensor]:
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [data[:length] for data, length in zip(out, lengths)]


def broadcast(obj: Any, src: int, group: Any = None) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (``obj`` is ignored elsewhere)."""
    device = _device(group)
    mine = _encode(obj, device) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    data = mine if dist.get_rank() == src else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    return _decode(data)
