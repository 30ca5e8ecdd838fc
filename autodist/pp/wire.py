"""Nested tensors between the stages of a pipeline: a block's output to the next stage, its gradient back, the
model's output to every stage. A structure goes as JSON (``torch.utils._pytree``'s spec and each leaf's shape
and dtype, or its plain value), then its tensors one by one; nothing a peer sends is unpickled.

Example:
    >>> send(rank_of_next_stage, (hidden, None), group)        # stage s
    >>> hidden, _ = recv(rank_of_previous_stage, group, device) # stage s + 1
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autodist.runtime.position import waiting

_PLAIN = (type(None), bool, int, float, str)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a stage sent a tensor of unknown dtype {name!r}")
    return dtype


def describe(obj: Any, what: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The tensors of ``obj`` and the JSON-able description that rebuilds it around them."""
    flat, spec = pytree.tree_flatten(obj)
    tensors, leaves = [], []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            leaves.append(["t", list(leaf.shape), str(leaf.dtype), leaf.requires_grad])
        elif isinstance(leaf, _PLAIN):
            leaves.append(["v", leaf])
        else:
            raise TypeError(f"{what} holds a {type(leaf).__name__}, which cannot go from one pipeline stage to the "
                            f"next (tensors, None, numbers, strings and tuples, lists and dicts of them can)")
    try:
        spec_text = pytree.treespec_dumps(spec)
    except Exception as err:  # noqa: BLE001 - a container pytree cannot name
        raise TypeError(f"{what} is a structure that cannot be described to another pipeline stage ({err})") from None
    return tensors, {"spec": spec_text, "leaves": leaves}


def rebuild(description: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)
    flat = [next(it) if leaf[0] == "t" else leaf[1] for leaf in description["leaves"]]
    return pytree.tree_unflatten(flat, pytree.treespec_loads(description["spec"]))


def empty_tensors(description: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(leaf[1], dtype=_dtype(leaf[2]), device=device)
            for leaf in description["leaves"] if leaf[0] == "t"]


def _header(description: dict[str, Any], device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(description).encode()), dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(data.cpu().tolist()).decode())


def send(obj: Any, dst: int, group: Any, device: torch.device, what: str) -> list[Any]:
    """Start sending ``obj`` to global rank ``dst``; the requests to wait for (keep ``obj`` alive until then)."""
    tensors, description = describe(obj, what)
    header = _header(description, device)
    size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    payload = [size, header, *(t.detach().to(device).contiguous() for t in tensors)]
    return [dist.isend(t, dst, group=group) for t in payload] + payload  # the tensors stay referenced until waited


def recv(src: int, group: Any, device: torch.device, what: str) -> tuple[Any, dict[str, Any]]:
    """What global rank ``src`` sent with :func:`send`, and its description."""
    with waiting(what):
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(size, src, group=group)
        header = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.recv(header, src, group=group)
        description = _decode(header)
        tensors = empty_tensors(description, device)
        for t in tensors:
            dist.recv(t, src, group=group)
    return rebuild(description, tensors), description


def send_tensors(tensors: list[torch.Tensor], dst: int, group: Any) -> list[Any]:
    """Start sending tensors whose shapes the receiver knows (gradients of what it sent)."""
    payload = [t.contiguous() for t in tensors]
    return [dist.isend(t, dst, group=group) for t in payload] + payload


def recv_tensors(like: list[torch.Tensor], src: int, group: Any, what: str) -> list[torch.Tensor]:
    with waiting(what):
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        for t in out:
            dist.recv(t, src, group=group)
    return out


def wait(pending: list[Any]) -> None:
    """Wait for the requests among ``pending`` (the tensors beside them are only kept alive)."""
    for item in pending:
        if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            item.wait()


def broadcast(obj: Any, src: int, group: Any, device: torch.device, what: str) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (a collective over it); a tensor that requires a
    gradient at ``src`` is a leaf that requires one on the other ranks."""
    mine = dist.get_rank() == src
    with waiting(what):
        if mine:
            tensors, description = describe(obj, what)
            header = _header(description, device)
        size = torch.tensor([header.numel() if mine else 0], dtype=torch.int64, device=device)
        dist.broadcast(size, src, group=group)
        if not mine:
            header = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.broadcast(header, src, group=group)
        if not mine:
            description = _decode(header)
            tensors = empty_tensors(description, device)
        for t in tensors:
            dist.broadcast(t.detach().to(device).contiguous() if mine else t, src, group=group)
    if mine:
        return obj
    wanted = [leaf[3] for leaf in description["leaves"] if leaf[0] == "t"]
    return rebuild(description, [t.requires_grad_(w) for t, w in zip(tensors, wanted)])
