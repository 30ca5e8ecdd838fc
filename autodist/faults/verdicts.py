"""How a rank's status reads in words, and the verdict that stops every rank.

The watchdog thread (:mod:`autodist.faults.watchdog`) publishes this rank's
:data:`autodist.runtime.position.record` once per tick as a :class:`Status`
and, when a rank waits too long, :func:`judge` turns the ranks' statuses into
the error every rank prints. Nothing here talks to other processes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Status:
    """What a rank publishes each tick (JSON in the store)."""

    rank: int
    seq: int = 0  # one more per publication: a heartbeat
    state: str = "running"
    note: str = ""
    syncs: int = 0
    position: Optional[list] = None  # [epoch, step, steps]
    data_end: Optional[list] = None  # [epoch, steps]
    wait: Optional[str] = None  # the collective it waits in, in words
    wait_s: float = 0.0
    stuck_s: float = 0.0  # how long its main thread has been at the same Python instruction
    stack: Optional[str] = None  # its main thread's Python stack, when stuck or waiting
    at: Optional[str] = None  # the innermost lines of the script's own code it runs, when not waiting
    host: str = ""
    pid: int = 0
    wall: float = 0.0  # time.time() of the publication (comparable only on the same host)
    extra: dict = field(default_factory=dict)

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def loads(text: str | bytes) -> "Status":
        return Status(**json.loads(text))


def where(status: Status) -> str:
    """Where a rank is, in words: its wait, or the last step it took.

    Example:
        >>> where(Status(rank=1, syncs=9, position=[0, 9, 11], stuck_s=61.0))
        'is in its own code after batch 9 of epoch 0 (9 gradient syncs done), at the same Python line for 61 s'
        >>> where(Status(rank=0, syncs=9, position=[0, 9, 11], at="train.py:88 in estimate_loss"))
        'is in its own code after batch 9 of epoch 0 (9 gradient syncs done) at train.py:88 in estimate_loss'
    """
    if status.state == "failed":
        return f"failed ({status.note})"
    done = f"{status.syncs} gradient sync{'s' if status.syncs != 1 else ''} done"
    if status.state == "exited":
        ended = f"; its data ended after batch {status.data_end[1]} of epoch {status.data_end[0]}" \
            if status.data_end else ""
        return f"reached the end of its script ({done}{ended})"
    if status.wait:
        return f"waits in {status.wait} for {status.wait_s:.0f} s"
    if status.data_end:
        at = f"finished its data after batch {status.data_end[1]} of epoch {status.data_end[0]} ({done})"
    elif status.position:
        at = f"is in its own code after batch {status.position[1]} of epoch {status.position[0]} ({done})"
    else:
        at = f"is in its own code ({done})"
    at += f" at {status.at}" if status.at else ""
    return at + (f", at the same Python line for {status.stuck_s:.0f} s" if status.stuck_s >= 2 else "")


def in_own_code(me: Status, statuses: dict[int, Status | None], silent_s: dict[int, float],
                timeout: float) -> list[int]:
    """The ranks ``me`` waits for, where every one of them is alive and in its own code (its heartbeat goes
    on, it waits in no collective): a rank evaluating, saving or logging alone. Empty where any rank is
    silent, never heard of, or waits in another collective, or where every rank waits in this one.

    Example:
        >>> me = Status(rank=1, wait="gradient sync #3", wait_s=70.0)
        >>> in_own_code(me, {0: Status(rank=0, at="train.py:88 in estimate_loss")}, {0: 0.4}, 60)
        [0]
        >>> in_own_code(me, {0: Status(rank=0, wait="torch.distributed.barrier called at train.py:90")}, {}, 60)
        []
    """
    busy = []
    for rank, status in sorted(statuses.items()):
        if status is None or silent_s.get(rank, 0.0) >= timeout or status.state != "running":
            return []
        if status.wait != me.wait:
            if status.wait is not None:
                return []
            busy.append(rank)
    return busy


def judge(me: Status, statuses: dict[int, Status | None], silent_s: dict[int, float], timeout: float,
          settle: float, busy: float | None = None, busy_words: str | None = None) -> str | None:
    """The error to stop every rank with, or None while waiting is still fine.

    ``me`` waits in a collective (``me.wait``, for ``me.wait_s`` seconds);
    ``statuses`` are the other ranks' last publications (None: never heard
    of), ``silent_s`` how long each has published nothing new. A rank that
    failed or ended its script can never join the collective: that is an error
    as soon as the status has had ``settle`` seconds to be current. A rank that
    is silent, or waits in another collective, is one after ``timeout``
    seconds; a collective every rank waits in is stuck once each has waited
    ``timeout`` seconds (a rank that arrived lately may yet complete it). Ranks alive in their own code (:func:`in_own_code`) are waited for
    ``busy`` seconds (None: ``timeout``; ``busy_words``: that limit in the message).

    Example:
        >>> me = Status(rank=0, wait="the gradient sync of batch 10 of epoch 0", wait_s=1.5)
        >>> judge(me, {1: Status(rank=1, state="exited", syncs=9, data_end=[0, 9])}, {1: 0.0}, 60, 1)
        'rank 1 reached the end of its script (9 gradient syncs done; its data ended after batch 9 of epoch 0) \
while rank 0 waits in the gradient sync of batch 10 of epoch 0: the ranks did not run the same collectives \
(every rank must take the same number of steps, and call collectives such as autodist.save on every rank)'
    """
    waiting = f"rank {me.rank} waits in {me.wait}"
    for rank, status in sorted(statuses.items()):
        if status is not None and status.state in ("failed", "stopped"):
            return f"rank {rank} {where(status) if status.state == 'failed' else 'was stopped'} while {waiting}"
    if me.wait_s >= settle:
        for rank, status in sorted(statuses.items()):
            if status is not None and status.state == "exited":
                return (f"rank {rank} {where(status)} while {waiting}: the ranks did not run the same "
                        f"collectives (every rank must take the same number of steps, and call collectives such as "
                        f"autodist.save on every rank)")
    if me.wait_s < timeout:
        return None
    limit = f"AUTODIST_TIMEOUT={timeout:g} s"
    if busy is not None and in_own_code(me, statuses, silent_s, timeout):
        if me.wait_s < busy:
            return None
        limit = (f"{busy_words or f'AUTODIST_BUSY_TIMEOUT={busy:g} s'}: how long a rank alive in its own code is "
                 f"waited for; raise it if a rank is legitimately busy this long")
    others, stacks = [], []
    for rank, status in sorted(statuses.items()):
        silent = silent_s.get(rank, 0.0)
        if status is None:
            others.append(f"rank {rank} never reported its progress (did it call autodist.parallelize?)")
        elif silent >= timeout:
            others.append(f"rank {rank} sent no heartbeat for {silent:.0f} s (killed, frozen, or its host is "
                          f"unreachable; last seen it {where(status)})")
        elif status.wait != me.wait:
            others.append(f"rank {rank} {where(status)}")
            if status.stack and status.state == "running":
                stacks.append(f"rank {rank}'s Python stack (most recent call last):\n{status.stack.rstrip()}")
    if not others:
        if any(status.wait_s < timeout for status in statuses.values() if status is not None):
            return None  # a rank arrived lately (from its own code): the collective may complete yet
        others.append("every rank waits in it, so the collective itself is stuck (the network between the ranks?)")
    return "\n".join([f"rank {me.rank} has waited {me.wait_s:.0f} s in {me.wait} for the other ranks: "
                      f"{'; '.join(others)} ({limit})", *stacks])


def still_waiting(me: Status, statuses: dict[int, Status | None], busy: list[int], busy_words: str) -> str:
    """The progress line of a rank that waits for ranks alive in their own code (:func:`in_own_code`).

    Example:
        >>> me = Status(rank=1, wait="the gradient sync of batch 3 of epoch 0", wait_s=60.4)
        >>> still_waiting(me, {0: Status(rank=0, syncs=2, position=[0, 3, 9], at="train.py:88 in estimate_loss")},
        ...               [0], "AUTODIST_BUSY_TIMEOUT=1800 s")
        'rank 1 has waited 60 s in the gradient sync of batch 3 of epoch 0 for rank 0, which is in its own code \
after batch 3 of epoch 0 (2 gradient syncs done) at train.py:88 in estimate_loss: its heartbeat goes on, so \
it is waited for up to AUTODIST_BUSY_TIMEOUT=1800 s'
    """
    names = "; ".join(f"rank {rank}, which {where(statuses[rank])}" for rank in busy)  # type: ignore[arg-type]
    beats, it = ("its heartbeat goes on", "it is") if len(busy) == 1 else ("their heartbeats go on", "they are")
    return (f"rank {me.rank} has waited {me.wait_s:.0f} s in {me.wait} for {names}: {beats}, so {it} waited for "
            f"up to {busy_words}")
