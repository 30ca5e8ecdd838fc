"""Where this rank is: the record the training loop updates, and the waits autodist's collectives mark.

The hot path only writes a few attributes of :data:`record` (a batch handed
out, a collective entered or left, :class:`waiting`); the watchdog thread
(:mod:`autodist.faults.watchdog`) reads it once per tick and publishes it.
Nothing here talks to other processes.

Example:
    >>> with waiting("sync"):      # around a blocking collective of autodist's
    ...     work.wait()
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from autodist.runtime import provenance

# A position in the data: (epoch, step of this epoch, steps the epoch has), step counted from 1.
Position = tuple[int, int, int]


class Record:
    """This rank's progress, written by the training loop (attribute stores only: it costs nothing).

    ``wait`` names the collective the loop is blocked in (:class:`waiting`):
    ``(kind, gradient syncs done at entry, data position at entry)``.
    """

    def __init__(self) -> None:
        self.progress = 0  # bumped at every progress point
        self.syncs = 0  # gradient syncs finished
        self.wait: tuple[str, int, Optional[Position]] | None = None
        self.wait_since = 0.0  # time.monotonic() when ``wait`` was entered
        self.wait_seq = 0  # one more per wait entered
        self.position: Position | None = None  # of the last batch a sharded loader handed out
        self.positions: dict[int, Position] = {}  # batch id -> position, the last few batches
        self.data_end: tuple[int, int] | None = None  # (epoch, steps) when the loader's epoch ended
        self.state = "running"  # "running", "exited" (end of script), "failed", "stopped" (by the watchdog)
        self.note = ""  # what it failed of

    def batch(self, batch_id: int, position: Position) -> None:
        """A sharded loader handed out a batch."""
        self.progress += 1
        self.position = position
        self.data_end = None
        positions = self.positions
        positions[batch_id] = position
        if len(positions) > 16:
            del positions[next(iter(positions))]


record = Record()


def wait_words(kind: str, syncs: int, position: Position | None) -> str:
    """A wait of :class:`Record` in words.

    Example:
        >>> wait_words("sync", 9, (0, 10, 11))
        'the gradient sync of batch 10 of epoch 0'
        >>> wait_words("sync", 9, None)
        'gradient sync #10'
    """
    at = f"batch {position[1]} of epoch {position[0]}" if position else None
    if kind in ("sync", "exchange"):  # "exchange": choosing how the buckets are summed, at a sync's start
        return f"the gradient sync of {at}" if at else f"gradient sync #{syncs + 1}"
    if kind == "count":
        return f"the sample-count all-reduce of a no_sync micro-batch{' at ' + at if at else ''}"
    if kind == "buffers":
        return f"the buffer sync (BatchNorm statistics) of gradient sync #{syncs + 1}"
    if kind == "order":
        return "the first batch of an epoch (every rank fetches it together: rank 0's sample order is broadcast)"
    if kind == "parameters":
        return "autodist.synchronize_model(model, what='parameters')"
    if kind == "exit":
        return "the end of its script"
    return kind  # a torch.distributed call, already in words


def _current_position() -> Position | None:
    share = provenance.current()
    return record.positions.get(share.batch, record.position) if share is not None else record.position


# Called with (the wait in words, the exception) when a marked collective fails; installed by the watchdog,
# which raises its own error instead where a peer is gone.
_on_failure: Callable[[str, BaseException], None] | None = None


def on_failure(hook: Callable[[str, BaseException], None] | None) -> None:
    """Have ``hook(wait in words, exception)`` see every marked collective that fails (None: nobody)."""
    global _on_failure
    _on_failure = hook


class waiting:
    """Marks a blocking collective of autodist's (``kind``: "sync", "exchange" at a sync's start, "count",
    "buffers", "order", "parameters"; only a finished "sync" counts as a gradient sync done).

    Costs two attribute stores; a collective that fails because a peer died raises the watchdog's error
    naming that peer (:func:`on_failure`) instead of gloo's socket error.
    """

    __slots__ = ("kind", "outer")

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self) -> None:
        self.outer = record.wait, record.wait_since
        record.wait = (self.kind, record.syncs, _current_position())
        record.wait_since = time.monotonic()
        record.wait_seq += 1

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        wait = record.wait
        record.wait, record.wait_since = self.outer
        record.progress += 1
        if exc is None:
            if self.kind == "sync":
                record.syncs += 1
            return
        if _on_failure is not None:
            _on_failure(wait_words(*wait), exc)  # type: ignore[misc]
