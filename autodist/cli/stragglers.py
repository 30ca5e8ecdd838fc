"""The ranks of an elastic job the launcher stops itself, so that ``autodist run --elastic`` always ends.

The ranks left after a loss drop a member whose heartbeat stopped (:mod:`autodist.faults.liveness`), but its
process is still there: stopped (SIGSTOP), or on a host cut off. Nothing would end it, and the launcher waits for
every rank it started. So the launcher, which hosts the store, reads each running member's heartbeat about once a
second and stops (SIGKILL) one whose count has not moved for ``AUTODIST_TIMEOUT`` plus a few seconds: by then the
members have gone on without it. A rank whose heartbeat goes on but which never ends (stuck in I/O) is stopped
``AUTODIST_EXIT_TIMEOUT`` plus a few seconds after a member reached the end of the script, when the others have
given up waiting for it there. Each is named as it is stopped.

Example:
    >>> watch = Stragglers(store, timeout=60.0, exit_timeout=30.0)
    >>> watch.due({2: 2})    # running slots and their member numbers
    [(2, "its heartbeat stopped 66 s ago (frozen: stopped, or its host cut off)")]
"""
from __future__ import annotations

import time
from typing import Any

GRACE = 5.0  # seconds past the ranks' own limits: they act first, the launcher after


class Stragglers:
    """Which running members to stop (see the module docstring); ``store`` answers ``beat(member)`` (a count or
    None) and ``said("finished")``."""

    def __init__(self, store: Any, timeout: float, exit_timeout: float) -> None:
        self.store, self.timeout, self.exit_timeout = store, timeout, exit_timeout
        self.beats: dict[int, tuple[int, float]] = {}  # member: (its count, when it last moved)
        self.finished_at: float | None = None
        self.looked = 0.0

    def due(self, running: dict[int, int]) -> list[tuple[int, str]]:
        """(slot, why) for each of the ``running`` slots (slot: member number) to stop now."""
        now = time.monotonic()
        if now - self.looked < 1.0:
            return []
        self.looked = now
        if self.finished_at is None and self.store.said("finished") is not None:
            self.finished_at = now
        due = []
        for slot, member in running.items():
            count = self.store.beat(member)
            last = self.beats.get(member)
            if count is not None and (last is None or last[0] != count):
                self.beats[member] = (count, now)
            elif last is not None and now - last[1] > self.timeout + GRACE:
                due.append((slot, f"its heartbeat stopped {now - last[1]:.0f} s ago (frozen: stopped, or its host "
                                  f"cut off), and the others went on without it after AUTODIST_TIMEOUT"))
                continue
            if self.finished_at is not None and now - self.finished_at > self.exit_timeout + GRACE:
                due.append((slot, f"still running {now - self.finished_at:.0f} s after a member reached the end of "
                                  f"the script (AUTODIST_EXIT_TIMEOUT)"))
        return due
