"""Lightning's barrier and broadcast over autodist's world: plain data as JSON, never pickled (what arrives from
another process is data, not code: :mod:`autodist.runtime.plain`)."""
from __future__ import annotations

import json
import pathlib
from typing import Any, TypeVar

import torch.distributed as dist

from autodist.runtime import plain
from autodist.runtime.position import waiting
from autodist.runtime.world import World

T = TypeVar("T")

_FAILED = "__autodist_broadcast_failed__"


def barrier(world: World) -> None:
    """Every rank waits for all the others (nothing to do in a world of one)."""
    if world.size == 1 or not dist.is_initialized():
        return
    with waiting("barrier"):  # the watchdog names the ranks that never arrive
        if world.backend == "nccl":
            dist.barrier(device_ids=[world.device.index])
        else:
            dist.barrier()


def _sendable(obj: Any) -> Any:
    """``obj`` as JSON can carry it: paths as strings."""
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [_sendable(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _sendable(v) for k, v in obj.items()}
    return obj


def _lists(value: Any) -> Any:
    """What JSON brought back, its arrays as lists (the runtime's decoder makes them tuples)."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def broadcast(obj: T, src: int, world: World) -> T:
    """Rank ``src``'s ``obj`` on every rank: numbers, strings, booleans, None, paths (as strings), and lists and
    dicts of them (tuples come back as lists). Anything else raises on every rank, naming its type.

    Example:
        >>> broadcast(checkpoint_dir, 0, world)   # rank 0's path on every rank
    """
    if world.size == 1 or not dist.is_initialized():
        return obj
    message = None
    if world.rank == src:
        try:
            json.dumps(_sendable(obj), allow_nan=True)
        except (TypeError, ValueError) as err:
            message = (f"AutodistStrategy.broadcast sends plain data as JSON (numbers, strings, booleans, None, paths, "
                       f"and lists and dicts of them), never pickled objects; rank {src} broadcast a "
                       f"{type(obj).__name__} ({err})")
    with waiting("broadcast"):
        value = plain.broadcast({_FAILED: message} if message else _sendable(obj), src)
    if isinstance(value, dict) and _FAILED in value:
        raise TypeError(value[_FAILED])  # on every rank: none is left waiting for the others
    return _lists(value)
