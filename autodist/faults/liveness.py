"""Which ranks of an elastic job are alive (:mod:`autodist.faults.elastic`): each rank's heartbeat, how long a
regroup waits for a missing rank, and the end of the script, where nobody waits for a rank that is gone.

Example:
    >>> beat(store, rank=2)                        # a thread raising beat/2 in the store every second
    >>> Alive(store, 60.0, 1800.0).given_up([2], generation=1, speaks=True)
    False
"""
from __future__ import annotations

import threading
import time
from typing import Any

from autodist.runtime import ending
from autodist.runtime.world import log

FINISHED = "finished"  # a member reached the end of its script: a rank still waiting to join leaves


def listed(text: str) -> tuple[int, ...]:
    """The ranks of a list kept in the store ("3,5," -> (3, 5)), as the ranks append themselves to it."""
    return tuple(int(r) for r in text.split(",") if r)


def named(ranks: Any, word: str = "rank") -> str:
    """``ranks`` in words: "rank 2", "ranks 0, 1", "none"."""
    ranks = list(ranks)
    return "none" if not ranks else f"{word}{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks))


class Heartbeats:
    """When each rank's heartbeat (``beat/{rank}`` in the store) last moved, as this rank has looked."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.moved: dict[int, tuple[int, float]] = {}  # rank: (its count, when it last moved)

    def still(self, rank: int, now: float) -> float:
        """Seconds the count of ``rank`` has not moved by ``now`` (0 at the first look)."""
        count = self.store.add(f"beat/{rank}", 0)
        if self.moved.get(rank, (None, 0.0))[0] != count:
            self.moved[rank] = (count, now)
        return now - self.moved[rank][1]


class Alive:
    """Which missing members of a regroup are still waited for: a rank whose heartbeat goes on (alive in its own
    code: evaluating or saving alone) up to ``AUTODIST_BUSY_TIMEOUT``, a silent one up to ``AUTODIST_TIMEOUT``."""

    def __init__(self, store: Any, timeout: float, busy: float) -> None:
        self.store, self.timeout, self.busy = store, timeout, busy
        self.began = self.looked = self.said = time.monotonic()
        self.beats = Heartbeats(store)

    def given_up(self, missing: list[int], generation: int, speaks: bool) -> bool:
        """Whether to stop waiting for ``missing``; ``speaks``: this rank says, once a minute, who is waited for."""
        now = time.monotonic()
        if now - self.looked < 0.5 and self.beats.moved:
            return False
        self.looked = now
        busy = [r for r in missing if self.beats.still(r, now) <= self.timeout]
        if not busy:
            return now - self.began > self.timeout
        if now - self.began > self.busy:
            return True
        if speaks and (now - self.said > 60 or (self.said == self.began and now - self.began > self.timeout)):
            self.said = now
            log.warning("elastic: generation %d waits for %s, alive in its own code (its heartbeat goes on): up to "
                        "AUTODIST_BUSY_TIMEOUT=%g s", generation, named(busy), self.busy)
        return False


def beat(store: Any, rank: int, every: float = 1.0) -> None:
    """This rank's heartbeat, in a thread of its own, on a store client of its own: a count raised every
    ``every`` seconds while the process runs (a frozen process's stops)."""
    stop = threading.Event()

    def beating() -> None:
        while not stop.is_set():
            try:
                store.add(f"beat/{rank}", 1)
            except Exception:  # noqa: BLE001 - the store (the launcher) is gone: the job is ending
                return
            stop.wait(every)

    thread = threading.Thread(target=beating, name="autodist-elastic-heartbeat", daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        ending.join_thread(thread)
    ending.stop_at_exit(halt)  # after the end's meeting, which reads it


class Meeting:
    """The end of the script (:mod:`autodist.runtime.ending`): each member of the last generation arrives, and
    nobody waits for a rank the launcher saw end, or for one whose heartbeat has been still for
    ``AUTODIST_TIMEOUT``."""

    busy_words = ""

    def __init__(self, state: Any) -> None:  # an autodist.faults.elastic.Elastic
        self.state = state
        self.beats = Heartbeats(state.store)

    def _waiting_for(self) -> list[int]:
        here = set(listed(self.state.store.get("end").decode()))
        gone = self.state.gone()
        return [r for r in self.state.members if r not in here and r not in gone and not self._silent(r)]

    def _silent(self, rank: int) -> bool:
        """Whether ``rank``'s heartbeat has been still for ``AUTODIST_TIMEOUT``: frozen (stopped, or its host cut
        off), as a regroup judges it; the launcher stops its process."""
        return self.beats.still(rank, time.monotonic()) > self.state.timeout

    def arrive(self) -> None:
        self.state.store.set(FINISHED, "1")
        self.state.store.append("end", f"{self.state.me},")
        while self._waiting_for():
            time.sleep(0.05)

    def missing(self) -> str:
        return f"{named(self._waiting_for())} of the elastic job did not reach the end of the script"

    def give_up(self, message: str) -> None:
        log.error("%s", message)
        ending.leave(1, message)

    def busy_line(self, waited: float) -> str | None:
        return None  # a member still missing at AUTODIST_EXIT_TIMEOUT is given up, busy or not
