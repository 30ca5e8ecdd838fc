"""The messages between workers and servers, on a gloo process group of their own (point-to-point, tagged).

A request is a header (int64 ``[op, clock, floats, bytes]``) and up to two
payloads: ``floats`` float32 elements (parameters, gradients) and ``bytes``
bytes of a blob (the optimizer's description, its state) holding data only:
tensors, numbers, strings, None, and lists / tuples / dicts of them. A blob is
read back with ``torch.load(weights_only=True)``, so a message that holds
anything else (an object whose unpickling would run code) is refused
(:class:`Refused`), never loaded. A reply is
an info header (int64 ``[version, slowest clock, floats, bytes]``) and the same
two payloads. Requests travel under one tag and replies under another, so a
rank that is both a worker and a server never mixes its two conversations with
a peer; each pair of ranks has at most one request outstanding in each direction.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from autodist.train import checkpoint_file

INIT, PUSH, ELASTIC, PULL, STATE, LOAD, DONE, FINAL, BYE = range(1, 10)
NAMES = {INIT: "init", PUSH: "push", ELASTIC: "elastic", PULL: "pull", STATE: "state", LOAD: "load", DONE: "done",
         FINAL: "final", BYE: "bye"}
REPLIES = {PUSH, ELASTIC, PULL, STATE, LOAD, FINAL}  # the requests a server answers
REQUEST_TAG, REPLY_TAG = 11, 12


@dataclass
class Message:
    """A request (``head`` = op, clock) or a reply (``head`` = version, slowest clock), with its payloads."""

    head: tuple[int, int]
    floats: torch.Tensor | None = None
    blob: Any = None


class Refused(ValueError):
    """A message whose blob is not plain data: it was not loaded."""


def encode(obj: Any) -> torch.Tensor | None:
    """``obj`` (data only, see the module's doc) as a uint8 tensor, None for None."""
    if obj is None:
        return None
    checkpoint_file.check_loadable(obj, "a message to the parameter servers (the optimizer's hyperparameters or "
                                        "state)")
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # the default protocol: the one torch.load(weights_only=True) reads
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(data: torch.Tensor | None, peer: int | None = None) -> Any:
    """The blob ``encode`` made; :class:`Refused` for anything but data (nothing else is unpickled)."""
    if data is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on an unexpected pickle protocol: the refusal says it
            return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load's refusal, or bytes that are no checkpoint at all
        sender = f"rank {peer}" if peer is not None else "a peer"
        detail = [line.strip() for line in str(exc).splitlines() if "nsupported" in line]
        raise Refused(f"a message from {sender} holds more than data (tensors, numbers, strings, and lists and "
                      f"dicts of them), so it was refused, not loaded ({detail[0] if detail else type(exc).__name__})"
                      ) from None


def send(group: Any, peer: int, tag: int, message: Message) -> list[Any]:
    """Start sending ``message`` to ``peer``; returns the works to wait for (they hold the tensors alive)."""
    blob = encode(message.blob)
    n_floats = 0 if message.floats is None else message.floats.numel()
    n_bytes = 0 if blob is None else blob.numel()
    header = torch.tensor([*message.head, n_floats, n_bytes], dtype=torch.int64)
    works = [(group.send([header], peer, tag), header)]
    for payload in (message.floats, blob):
        if payload is not None and payload.numel():
            payload = payload.contiguous()
            works.append((group.send([payload], peer, tag), payload))
    return works


def recv(group: Any, peer: int, tag: int) -> Message:
    """Receive one message from ``peer`` (blocks; raises RuntimeError when the peer is gone)."""
    header = torch.empty(4, dtype=torch.int64)
    group.recv([header], peer, tag).wait()
    a, b, n_floats, n_bytes = header.tolist()
    floats = blob = None
    if n_floats:
        floats = torch.empty(n_floats, dtype=torch.float32)
        group.recv([floats], peer, tag).wait()
    if n_bytes:
        blob = torch.empty(n_bytes, dtype=torch.uint8)
        group.recv([blob], peer, tag).wait()
    return Message((a, b), floats, decode(blob, peer))


def wait(works: list[Any]) -> None:
    for work, _ in works:
        work.wait()
