"""The bytes a process moves through ``torch.distributed`` and the seconds it waits on them, counted alike for
autodist and for torch's own parallelism. Not a benchmark itself.

:class:`Meter` wraps, while it is entered, the calls a pipeline and data parallelism make (``send``, ``recv``,
``isend``, ``irecv``, ``broadcast``, ``all_reduce``, in ``torch.distributed`` and in its ``distributed_c10d``,
which ``P2POp`` checks against) and ``Work.wait``. A call made inside a counted one (``send`` starts an ``isend``
and waits for it; a collective waits for its own work) counts once, in the outer call. Other collectives
(all-gather, reduce-scatter) are not counted.

What it counts (:class:`Tally`): the tensor bytes sent and received point to point, broadcast from this rank and to
it, and all-reduced; ``out``, the bytes this rank puts on the link (its point-to-point sends, ``n - 1`` copies of
what it broadcasts to ``n`` ranks, ``2 (n - 1) / n`` of what it all-reduces, as a ring does); ``calls``, the counted
calls (each a message or a collective, whose latency a slow link adds to the step); and ``waited``, the
seconds the thread that entered the meter spent blocked inside a counted call (``recv``, ``send``, a collective
without ``async_op``) or inside ``Work.wait()``: time it could not compute.

Example:
    >>> with Meter() as meter:
    ...     before = meter.tally()
    ...     train_step()
    ...     meter.tally() - before
    Tally(sent=2097152, received=2097152, broadcast_out=0, broadcast_in=2097230, all_reduce=659456, out=2756608.0,
          calls=31, waited=0.021)
"""
from __future__ import annotations

import threading
import time
from dataclasses import astuple, dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

Work = torch._C._distributed_c10d.Work
SENDS, RECEIVES, COLLECTIVES = ("send", "isend"), ("recv", "irecv"), ("broadcast", "all_reduce")
BLOCKING_P2P = ("send", "recv")


@dataclass
class Tally:
    """Bytes by kind and seconds spent waiting (see the module docstring)."""

    sent: int = 0
    received: int = 0
    broadcast_out: int = 0
    broadcast_in: int = 0
    all_reduce: int = 0
    out: float = 0.0
    calls: int = 0
    waited: float = 0.0

    def __sub__(self, other: "Tally") -> "Tally":
        return Tally(*(a - b for a, b in zip(astuple(self), astuple(other))))

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def per(self, steps: int) -> "Tally":
        """The tally of one step, ``steps`` steps' counts divided by their number."""
        return Tally(*(v / max(steps, 1) for v in astuple(self)))


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a call, given at position ``index`` (after the tensor) or by keyword."""
    return args[index] if len(args) > index else kwargs.get(name, default)


class Meter:
    """Counts bytes and waiting through ``torch.distributed`` while entered (see the module docstring)."""

    def __init__(self) -> None:
        self.counts = Tally()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._thread = threading.get_ident()
        self._saved: dict[str, Callable] = {}

    def tally(self) -> Tally:
        """What was counted so far (a copy)."""
        with self._lock:
            return replace(self.counts)

    # -- the wrappers -----------------------------------------------------------------------------
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _timed(self, call: Callable[[], Any], blocking: bool) -> Any:
        """``call()`` as the outermost counted call: deeper ones pass straight through; its time is waiting
        where it blocks and runs on the meter's thread."""
        self._local.depth = self._depth() + 1
        start = time.perf_counter()
        try:
            return call()
        finally:
            self._local.depth -= 1
            if blocking and threading.get_ident() == self._thread:
                with self._lock:
                    self.counts.waited += time.perf_counter() - start

    def _count(self, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """Add the call's bytes; whether it blocks."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.counts.calls += 1
            if name in SENDS:
                self.counts.sent += nbytes
                self.counts.out += nbytes
            elif name in RECEIVES:
                self.counts.received += nbytes
            else:
                group = _argument(args, kwargs, 1, "group", None)
                ranks = dist.get_world_size(group)
                if name == "all_reduce":
                    self.counts.all_reduce += nbytes
                    self.counts.out += nbytes * 2 * (ranks - 1) / ranks
                elif self._is_source(args, kwargs, group):
                    self.counts.broadcast_out += nbytes
                    self.counts.out += nbytes * (ranks - 1)
                else:
                    self.counts.broadcast_in += nbytes
        return name in BLOCKING_P2P or (name in COLLECTIVES and not _argument(args, kwargs, 2, "async_op", False))

    @staticmethod
    def _is_source(args: tuple, kwargs: dict, group: Any) -> bool:
        src = _argument(args, kwargs, 0, "src", None)
        if src is not None:
            return src == dist.get_rank()
        return kwargs.get("group_src") == dist.get_rank(group)

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._depth():
                return original(tensor, *args, **kwargs)
            blocking = self._count(name, tensor, args, kwargs)
            return self._timed(lambda: original(tensor, *args, **kwargs), blocking)

        counted.__name__ = counted.__qualname__ = original.__name__  # P2POp prints op.__name__
        return counted

    def _wrap_wait(self, original: Callable) -> Callable:
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth():
                return original(work, *args, **kwargs)
            return self._timed(lambda: original(work, *args, **kwargs), blocking=True)

        return wait

    # -- entering and leaving ----------------------------------------------------------------------
    def __enter__(self) -> "Meter":
        for name in SENDS + RECEIVES + COLLECTIVES:
            self._saved[name] = getattr(c10d, name)
            counted = self._wrap(name, self._saved[name])
            setattr(c10d, name, counted)
            setattr(dist, name, counted)
        self._saved["wait"] = Work.wait
        Work.wait = self._wrap_wait(Work.wait)
        return self

    def __exit__(self, *exc: Any) -> None:
        Work.wait = self._saved.pop("wait")
        for name, original in self._saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._saved.clear()
