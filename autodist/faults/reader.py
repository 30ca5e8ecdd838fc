"""One rank reads every status; the others read its digest: the watchdog's traffic grows as the ranks, not
their square.

Every rank writes its status once a tick and reads two small keys in one
request: the verdict (empty until some rank must stop every rank) and the
digest. One rank, the reader (the lowest rank, 0, to begin with), also reads
every status in one ``multi_get`` a tick, judges each collective the ranks
wait in (:func:`autodist.faults.verdicts.judge`, for the rank that has waited
in it longest), and writes the :class:`Digest`: the progress lines that are
due (each said by the rank that says it today), and what a rank needs to
explain a lost peer, end its script or leave (who failed, who fell silent,
who has not ended). Per tick that is ``2 N + 2`` requests to the store, and
only the reader's read grows with the ranks.

The digest names the reader's successors. A rank that sees the digest
unchanged for ``STALE_TICKS`` ticks times its place among them (the reader
frozen, or gone while the store lives on) starts reading itself; a reader
that finds a newer digest by another rank stops.

Example:
    >>> reader = Reader(store, rank=0, size=1000, timeout=60.0, tick=1.0, busy=1800.0, busy_words="...")
    >>> verdict, digest = reader.turn(my_status)   # the reader's watchdog thread, once a tick
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from autodist.faults.verdicts import Status, in_own_code, judge, still_waiting
from autodist.faults.verdicts import where as where_is
from autodist.runtime.position import wait_words

STALE_TICKS = 3  # a digest this many ticks old, times a successor's place, hands it the reading
SUCCESSORS = 3  # how many successors a digest names
NAMED = 16  # at most this many ranks of a kind (silent, not ended) named in a digest: it stays small
AT_THE_END = wait_words("exit", 0, None)  # the status's wait while a rank waits at the end of its script


@dataclass
class Digest:
    """What the reader writes once a tick (JSON in the store); a few hundred bytes whatever the ranks."""

    by: int  # the reader
    seq: int
    successors: list[int] = field(default_factory=list)  # who reads next, in order, if this digest grows old
    say: dict[int, list] = field(default_factory=dict)  # rank -> [line id, progress line] for it to print
    gone: dict[int, str] = field(default_factory=dict)  # the lowest ranks failed, ended or stopped: where
    silent: dict[int, float] = field(default_factory=dict)  # ranks silent 1.5 ticks or more: seconds
    unfinished: list[int] = field(default_factory=list)  # the lowest ranks that have not reached their end
    unfinished_count: int = 0
    first_ended: int | None = None  # the lowest rank that reached the end of its script
    lost: list[int] | None = field(default_factory=list)  # ranks not alive (None: more than NAMED)
    left: list[int] = field(default_factory=list)  # the lowest ranks a parameter-server mode declared gone
    left_count: int = 0  # all of them
    ended: bool = False  # every rank ended its script, failed, or fell silent for AUTODIST_TIMEOUT

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def loads(text: str | bytes) -> "Digest":
        data = json.loads(text)
        for name in ("say", "gone", "silent"):
            data[name] = {int(k): v for k, v in data[name].items()}
        return Digest(**data)


def gone(statuses: dict[int, Status | None]) -> dict[int, str]:
    """The ranks that failed, ended their script or were stopped, and where each is, in words, as a lost peer's
    explanation names them."""
    return {r: "was stopped by the watchdog" if s.state == "stopped" else where_is(s)
            for r, s in sorted(statuses.items()) if s is not None and s.state in ("failed", "exited", "stopped")}


def first_readers(size: int, left: set[int]) -> list[int]:
    """Who reads while no digest was written yet: the lowest ranks, in order."""
    return [r for r in range(size) if r not in left][:SUCCESSORS + 1]


class Reader:
    """The reading rank's side: every status in, a verdict or a digest out."""

    def __init__(self, store: Any, rank: int, size: int, timeout: float, tick: float, busy: float,
                 busy_words: str, line_every: float | None = None) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.timeout, self.tick, self.busy, self.busy_words = timeout, tick, busy, busy_words
        self.line_every = line_every if line_every is not None else min(60.0, timeout)
        self.heard: dict[int, tuple[int, float]] = {}  # rank -> (seq, monotonic time it last changed)
        self.left: set[int] = set()  # ranks a parameter-server mode declared gone: no longer waited for
        self.left_seen = 0
        self.lines: dict[tuple[int, str], float] = {}  # (speaker, wait) -> wait_s its next line is due at
        self.say: dict[int, list] = {}  # speaker -> [line id, line], while that wait lasts
        self.said = 0
        self.seq = 0
        self.keys_made = False
        self.statuses: dict[int, Status | None] = {}
        self.silent: dict[int, float] = {}
        self.suspects: dict[int, tuple[str, int, int]] = {}  # rank -> (its wait, syncs, seq): a verdict seen once

    def since(self, rank: int, seq: int, when: float) -> None:
        """Rank ``rank`` was last heard of (its ``seq``) at ``when``: a reader that takes over from a frozen one
        counts that one's silence from its last digest, not from now."""
        self.heard[rank] = (seq, when)

    # -- reading -----------------------------------------------------------------------------------
    def read(self, me: Status) -> tuple[dict[int, Status | None], dict[int, float]]:
        """Every rank's last status (this rank's is ``me``) and how long each has published nothing new, in one
        request (plus the ranks that left, one by one, when a parameter server said some did)."""
        now, wall = time.monotonic(), time.time()
        ranks = [r for r in range(self.size) if r != self.rank and r not in self.left]
        keys = [f"status/{r}" for r in ranks]
        if not self.keys_made:
            self._make_keys(keys)
        *values, left = self.store.multi_get(keys + ["left_count"])
        statuses: dict[int, Status | None] = {self.rank: me}
        for rank, value in zip(ranks, values):
            status = Status.loads(value) if value else None
            statuses[rank] = status
            seq = status.seq if status is not None else -1
            if self.heard.get(rank, (None,))[0] != seq:
                self.heard[rank] = (seq, now)
        silent = {rank: now - self.heard[rank][1] for rank in ranks}
        for rank in ranks:
            status = statuses[rank]
            if status is not None and status.host == me.host:  # its own clock: exact whatever the reading's age
                silent[rank] = max(silent[rank], wall - status.wall)
        silent[self.rank] = 0.0
        if int(left or 0) != self.left_seen:
            self._read_left(int(left))
            for rank in self.left:
                statuses.pop(rank, None)
                silent.pop(rank, None)
        self.statuses, self.silent = statuses, silent
        return statuses, silent

    def _make_keys(self, keys: list[str]) -> None:
        """Every status key exists (empty until its rank publishes), so that one ``multi_get`` reads them all:
        one request per key, once, where some rank has not published yet."""
        if not self.store.check(keys + ["left_count"]):
            self.store.add("left_count", 0)
            for key in keys:
                self.store.compare_set(key, "", "")
        self.keys_made = True

    def _read_left(self, count: int) -> None:
        for rank in range(self.size):
            if rank != self.rank and rank not in self.left and self.store.check([f"left/{rank}"]):
                self.left.add(rank)
                self.heard.pop(rank, None)
        self.left_seen = count

    # -- judging -----------------------------------------------------------------------------------
    def turn(self, me: Status) -> tuple[tuple[int, str] | None, Digest]:
        """Read, judge and write the digest: the verdict (the rank it is said for, the message) if one is due."""
        statuses, silent = self.read(me)
        verdict = self.judge(statuses, silent)
        digest = self.digest(statuses, silent)
        self.store.set("digest", digest.dumps())
        return verdict, digest

    def _now(self, status: Status) -> Status:
        """A waiting rank's status with its wait as long as it is now (published up to a tick ago)."""
        if status.rank == self.rank:
            return status
        age = time.time() - status.wall if status.host == self.statuses[self.rank].host else \
            time.monotonic() - self.heard[status.rank][1]
        return dataclasses.replace(status, wait_s=status.wait_s + max(0.0, age))

    def judge(self, statuses: dict[int, Status | None], silent: dict[int, float]) -> tuple[int, str] | None:
        """For each collective some alive rank waits in: the verdict of the rank that has waited in it longest,
        as it would find it; else the progress line of the lowest rank waiting in it, where one is due."""
        groups: dict[str, list[Status]] = {}
        for rank, status in sorted(statuses.items()):
            if status is not None and status.state == "running" and status.wait and status.wait != AT_THE_END \
                    and silent.get(rank, 0.0) < 2 * self.tick:
                groups.setdefault(status.wait, []).append(self._now(status))
        due: dict[int, list] = {}
        suspected: set[int] = set()
        for wait, members in groups.items():
            first = max(members, key=lambda s: (s.wait_s, -s.rank))
            if first.wait_s < self.tick:
                continue
            others = {r: s for r, s in statuses.items() if r != first.rank}
            message = judge(first, others, silent, self.timeout, self.tick, self.busy, self.busy_words)
            if message is not None:
                if self._confirmed(first):
                    return first.rank, message
                suspected.add(first.rank)
                continue
            line = self._line(members[0], wait, statuses, silent)
            if line is not None:
                due[members[0].rank] = line
        self.suspects = {rank: seen for rank, seen in self.suspects.items() if rank in suspected}
        self.lines = {key: at for key, at in self.lines.items() if key[1] in groups}  # waits that ended: forgotten
        speaking = {rank for rank, _ in self.lines}
        self.say = {rank: said for rank, said in self.say.items() if rank in speaking}
        self.say.update(due)
        return None

    def _confirmed(self, waiter: Status) -> bool:
        """Whether the verdict found for ``waiter`` stands on a newer status of it, still in the same wait with
        the same syncs done. The statuses are read together but published apart: a waiter's may be up to a tick
        old, while another rank's, newer, shows it past the collective the waiter had already left."""
        seen = self.suspects.get(waiter.rank)
        if seen is not None and seen[:2] == (waiter.wait, waiter.syncs):
            return waiter.seq > seen[2] or waiter.rank == self.rank
        self.suspects[waiter.rank] = (waiter.wait or "", waiter.syncs, waiter.seq)
        return False

    def _line(self, speaker: Status, wait: str, statuses: dict[int, Status | None],
              silent: dict[int, float]) -> list | None:
        """The progress line the lowest rank waiting in ``wait`` says, when due: once AUTODIST_TIMEOUT has
        passed while the ranks it waits for are alive in their own code, then every ``line_every`` seconds."""
        if speaker.wait_s < self.timeout:
            return None
        others = {r: s for r, s in statuses.items() if r != speaker.rank}
        busy = in_own_code(speaker, others, silent, self.timeout)
        if not busy:
            return None
        at = self.lines.setdefault((speaker.rank, wait), self.timeout)
        if speaker.wait_s < at:
            return None
        self.lines[speaker.rank, wait] = at + self.line_every * max(1, (speaker.wait_s - at) // self.line_every + 1)
        self.said += 1
        return [f"{self.rank}.{self.said}", still_waiting(speaker, others, busy, self.busy_words)]

    # -- the digest --------------------------------------------------------------------------------
    def digest(self, statuses: dict[int, Status | None], silent: dict[int, float]) -> Digest:
        self.seq += 1
        alive = [r for r, s in sorted(statuses.items()) if s is not None
                 and s.state in ("running", "exited", "stopped") and silent.get(r, 0.0) < 2 * self.tick]
        lost = sorted(set(statuses) - set(alive))
        unfinished = [r for r, s in sorted(statuses.items()) if s is None or s.state != "exited"]
        quiet = {r: round(s, 2) for r, s in sorted(silent.items()) if s >= 1.5 * self.tick}
        return Digest(
            by=self.rank, seq=self.seq, successors=[r for r in alive if r != self.rank][:SUCCESSORS],
            say=self.say, gone=dict(list(gone(statuses).items())[:4]), silent=dict(list(quiet.items())[:NAMED]),
            unfinished=unfinished[:NAMED], unfinished_count=len(unfinished),
            first_ended=next((r for r, s in sorted(statuses.items()) if s is not None and s.state == "exited"), None),
            lost=lost if len(lost) <= NAMED else None, left=sorted(self.left)[:NAMED], left_count=len(self.left),
            ended=all(s is not None and s.state != "running" or silent.get(r, 0.0) >= self.timeout
                      for r, s in statuses.items()))
