"""The fence between the phases of a sum in shared memory: every rank of the group has arrived.

A sum in shared memory (:mod:`autodist.runtime.shared_slots`) has phases: every
rank writes its slot; every rank sums its part of every slot; every rank takes
the sum. Between two phases each rank must know that every other rank has
finished the one before. Gloo's all-reduce of one number says so, through TCP on
loopback, in 0.4-0.8 ms on busy cores, and it returns to one rank before the
other (on 2 ranks of a 2-core machine, the second by about a millisecond, step
after step). :class:`SharedFence` says it in microseconds: each rank owns one
cache line of the shared file, counts its arrivals there, and waits until every
rank's count has reached its own.

That is correct only where a store the other ranks see means every store before
it is seen too. x86-64 keeps stores in order and loads in order (its memory
model, TSO), and the sums' writes are done (the kernels have returned, their
threads joined) before the count is written; other processors (ARM, POWER)
reorder them, and Python has no fence to put between. So the shared fence is
taken on x86-64 only, and where every rank sees the others' processes (one pid
namespace: a rank that dies is seen dead); gloo's :class:`GlooFence` otherwise.

A rank that waits spins a little (the others are usually microseconds away),
then sleeps 50 microseconds between looks, leaving its core to the others (a
rank it waits for may share that core, or be its hyperthread sibling; 4
ranks on 2 cores sum 1 MB in 0.9 ms this way, 1.3 ms yielding the core
instead, and 2 ranks on 2 cores train alike either way). A longer wait looks
less often: each sleep at most a twentieth of the wait so far, and 2 ms at
most, so that a rank waiting for one evaluating alone or for a straggler costs
about 3% of a core (15% at a look every 50 microseconds) and sees the
arrival within 5% of how long it waited. It checks that the
ranks it waits for are alive every few milliseconds (every 0.1 s in a wait of
seconds) and raises
:class:`PeerGone` if one is not (killed, out of memory): gloo's all-reduce
fails at once there too; the watchdog names the rank
(:mod:`autodist.faults.watchdog`) as for gloo's error. A rank that is alive but
never arrives is the watchdog's to name after ``AUTODIST_TIMEOUT``, as for any
collective.

Example:
    >>> fence = choose(mapping, 0, group)   # a collective; the file's first fence_bytes(size) bytes are its own
    >>> slots[rank].copy_(mine)
    >>> fence.wait()                        # every rank has written its slot
"""
from __future__ import annotations

import mmap
import os
import platform
import time
from typing import Union

import torch
import torch.distributed as dist

LINE = 64  # bytes: one cache line per rank, so one rank's count never shares a line with another's
WORDS = LINE // 8
COUNT, PID, NAMESPACE = 0, 1, 2  # the words of a rank's line
SPIN_POLLS = 256  # looks before the first sleep: a few tens of microseconds
SLEEP_S = 0.00005  # then a sleep between looks, so that the core (or its hyperthread sibling) is the others'
BACKOFF = 0.05  # a sleep is at most this part of the time waited so far: the arrival seen within 5% of the wait
SLEEP_MAX_S = 0.002  # and at most this long
ALIVE_EVERY_S = 0.005  # how often a waiting rank checks that the ranks it waits for still live (backing off
ALIVE_MAX_S = 0.1  # as its looks do, up to this: a rank that died is seen within 5% of the wait, or 0.1 s)


class PeerGone(RuntimeError):
    """A rank this rank waits for in a fence is no longer alive: ``rank``, its rank in the world."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def fence_bytes(size: int) -> int:
    """The bytes of a shared file that the fence of ``size`` ranks uses (its first ones)."""
    return size * LINE


class GlooFence:
    """The backend's all-reduce of one number."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group, self.flag = group, torch.zeros(1)

    def wait(self) -> None:
        dist.all_reduce(self.flag.zero_(), group=self.group)


class SharedFence:
    """Counts of arrivals in cache lines of a shared file, one line per rank of the group."""

    name = "shared memory"

    def __init__(self, mapping: mmap.mmap, offset: int, rank: int, size: int,
                 world_ranks: list[int] | None = None) -> None:
        self.lines = memoryview(mapping)[offset:offset + fence_bytes(size)].cast("q")
        self.rank, self.size = rank, size
        self.world_ranks = list(range(size)) if world_ranks is None else world_ranks  # each group rank's
        self.count = self.lines[rank * WORDS + COUNT]
        self.others = [r * WORDS + COUNT for r in range(size) if r != rank]
        self.pids = {r: self.lines[r * WORDS + PID] for r in range(size) if r != rank}

    def wait(self) -> None:
        """Until every rank of the group has called this as often as this rank has."""
        self.count += 1
        lines, count, others = self.lines, self.count, self.others
        lines[self.rank * WORDS + COUNT] = count
        polls = 0
        while True:
            if all(lines[i] >= count for i in others):
                return
            polls += 1
            if polls < SPIN_POLLS:
                continue
            if polls == SPIN_POLLS:
                checked = began = time.monotonic()
                sleep = SLEEP_S
            time.sleep(sleep)
            now = time.monotonic()
            part = BACKOFF * (now - began)  # a twentieth of the wait so far
            sleep = min(SLEEP_MAX_S, max(SLEEP_S, part))
            if now - checked >= min(ALIVE_MAX_S, max(ALIVE_EVERY_S, part)):
                checked = now
                self._check_alive(count)

    def _check_alive(self, count: int) -> None:
        for rank, pid in self.pids.items():
            if self.lines[rank * WORDS + COUNT] < count and not _alive(pid):
                raise PeerGone(f"rank {rank} of the group (process {pid} of this machine) is gone: it ended "
                               f"while this rank waits for it in a sum in shared memory", self.world_ranks[rank])

    def close(self) -> None:
        """Let the mapping go (a memoryview of it would keep it open)."""
        self.lines.release()


Fence = Union[GlooFence, SharedFence]


def announce(mapping: mmap.mmap, offset: int, rank: int) -> None:
    """Write this rank's line: no arrivals yet, its process id, its pid namespace (0 where unknown). Before the
    collective that says every rank mapped the file."""
    line = memoryview(mapping)[offset + rank * LINE:offset + (rank + 1) * LINE].cast("q")
    line[COUNT], line[PID], line[NAMESPACE] = 0, os.getpid(), _pid_namespace()
    line.release()


def choose(mapping: mmap.mmap, offset: int, group: dist.ProcessGroup | None) -> Fence:
    """The shared fence where it is safe (x86-64, one pid namespace known to every rank), gloo's otherwise.
    After every rank of ``group`` has :func:`announce`d itself in ``mapping`` and a collective since: every rank
    reads the same lines, so every rank chooses alike."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    lines = memoryview(mapping)[offset:offset + fence_bytes(size)].cast("q")
    spaces = {lines[r * WORDS + NAMESPACE] for r in range(size)}
    lines.release()
    if platform.machine().lower() in ("x86_64", "amd64") and len(spaces) == 1 and 0 not in spaces:
        world_ranks = list(range(size)) if group is None else dist.get_process_group_ranks(group)
        return SharedFence(mapping, offset, rank, size, world_ranks)
    return GlooFence(group)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux, or no /proc: the ranks' processes cannot be watched
        return 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X", b"x")
