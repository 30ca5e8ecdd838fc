"""Nested tensors between the stages of a pipeline: a block's output to the next stage, its gradient back, the
model's output to every stage. A structure goes as JSON (``torch.utils._pytree``'s spec and each leaf's shape
and dtype, or its plain value; a number without a gradient, such as a loss to log, inside it) in one message
of ``HEADER`` bytes (a longer one in two), then its tensors one by one; nothing a peer sends is unpickled.

Example:
    >>> send(rank_of_next_stage, (hidden, None), group)        # stage s
    >>> hidden, _ = recv(rank_of_previous_stage, group, device) # stage s + 1
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autodist.runtime.comm import carrier
from autodist.runtime.position import waiting

_PLAIN = (type(None), bool, int, float, str)
HEADER = 512  # bytes: the length of the JSON, then as much of it as fits


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
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and not leaf.requires_grad and leaf.device.type == "cpu":
            leaves.append(["s", leaf.item(), str(leaf.dtype)])  # exact: JSON writes a float as it reads back
        elif isinstance(leaf, torch.Tensor):
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
    flat = [next(it) if leaf[0] == "t" else torch.tensor(leaf[1], dtype=_dtype(leaf[2])) if leaf[0] == "s"
            else leaf[1] for leaf in description["leaves"]]
    return pytree.tree_unflatten(flat, pytree.treespec_loads(description["spec"]))


def empty_tensors(description: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(leaf[1], dtype=_dtype(leaf[2]), device=device)
            for leaf in description["leaves"] if leaf[0] == "t"]


def _headers(description: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    """The JSON of ``description`` in a message of HEADER bytes (its length first), and the rest if it is longer."""
    text = json.dumps(description).encode()
    data = len(text).to_bytes(8, "little") + text
    first = bytearray(data[:HEADER].ljust(HEADER, b"\0"))
    rest = [torch.frombuffer(bytearray(data[HEADER:]), dtype=torch.uint8).to(device)] if len(data) > HEADER else []
    return [torch.frombuffer(first, dtype=torch.uint8).to(device), *rest]


def _length(first: torch.Tensor) -> int:
    return int.from_bytes(bytes(first[:8].cpu().tolist()), "little")


def _decode(first: torch.Tensor, rest: torch.Tensor | None) -> dict[str, Any]:
    data = bytes(first[8:8 + _length(first)].cpu().tolist()) + (bytes(rest.cpu().tolist()) if rest is not None else b"")
    return json.loads(data.decode())


def _rest(first: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The buffer for what did not fit the first message (None: it all did)."""
    over = 8 + _length(first) - HEADER
    return torch.empty(over, dtype=torch.uint8, device=device) if over > 0 else None


def send(obj: Any, dst: int, group: Any, device: torch.device, what: str) -> list[Any]:
    """Start sending ``obj`` to global rank ``dst``; the requests to wait for (keep ``obj`` alive until then)."""
    tensors, description = describe(obj, what)
    on = carrier(device, group)
    payload = [*_headers(description, on), *(t.detach().to(on).contiguous() for t in tensors)]
    return [dist.isend(t, dst, group=group) for t in payload] + payload  # the tensors stay referenced until waited


def recv(src: int, group: Any, device: torch.device, what: str) -> tuple[Any, dict[str, Any]]:
    """What global rank ``src`` sent with :func:`send`, and its description."""
    with waiting(what):
        description, tensors = _take(lambda t: dist.recv(t, src, group=group), carrier(device, group))
    return rebuild(description, [t.to(device) for t in tensors]), description


def _take(fill: Callable[[torch.Tensor], Any], device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A description and its tensors, each buffer filled by ``fill`` (a receive or a broadcast) in turn."""
    first = torch.empty(HEADER, dtype=torch.uint8, device=device)
    fill(first)
    rest = _rest(first, device)
    if rest is not None:
        fill(rest)
    description = _decode(first, rest)
    tensors = empty_tensors(description, device)
    for t in tensors:
        fill(t)
    return description, tensors


def send_tensors(tensors: list[torch.Tensor], dst: int, group: Any) -> list[Any]:
    """Start sending tensors whose shapes the receiver knows (gradients of what it sent)."""
    payload = [t.to(carrier(t.device, group)).contiguous() for t in tensors]
    return [dist.isend(t, dst, group=group) for t in payload] + payload


def recv_tensors(like: list[torch.Tensor], src: int, group: Any, what: str) -> list[torch.Tensor]:
    with waiting(what):
        out = [torch.empty_like(t, memory_format=torch.contiguous_format, device=carrier(t.device, group))
               for t in like]
        for t in out:
            dist.recv(t, src, group=group)
    return [t.to(like_.device) for t, like_ in zip(out, like)]


def wait(pending: list[Any]) -> None:
    """Wait for the requests among ``pending`` (the tensors beside them are only kept alive)."""
    for item in pending:
        if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            item.wait()


def broadcast(obj: Any, src: int, group: Any, device: torch.device, what: str) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (a collective over it); a tensor that requires a
    gradient at ``src`` is a leaf that requires one on the other ranks."""
    with waiting(what):
        if dist.get_rank() == src:
            tensors, description = describe(obj, what)
            for t in [*_headers(description, device), *(t.detach().to(device).contiguous() for t in tensors)]:
                dist.broadcast(t, src, group=group)
            return obj
        description, tensors = _take(lambda t: dist.broadcast(t, src, group=group), device)
    wanted = [leaf[3] for leaf in description["leaves"] if leaf[0] == "t"]
    return rebuild(description, [t.requires_grad_(w) for t, w in zip(tensors, wanted)])
