"""The launcher's rule for ranks of an elastic job that never end (autodist/cli/stragglers.py), on a clock it
reads: a heartbeat still past AUTODIST_TIMEOUT, or a rank running past AUTODIST_EXIT_TIMEOUT after a member
finished. The whole behaviour, with real processes, is tests/faults/test_elastic.py -k frozen."""
from __future__ import annotations

import pytest

from autodist.cli import stragglers
from autodist.cli.stragglers import GRACE, Stragglers


class _Beats:
    """What the launcher reads of its store: each member's heartbeat count, and whether one finished."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.finished = False

    def beat(self, member: int) -> int | None:
        return self.counts.get(member)

    def said(self, name: str) -> str | None:
        return "1" if name == "finished" and self.finished else None


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(stragglers.time, "monotonic", lambda: now[0])
    return now


def test_a_still_heartbeat_is_stopped_after_the_timeout_and_a_moving_one_never(clock):
    beats = _Beats()
    watch = Stragglers(beats, timeout=10.0, exit_timeout=30.0)
    beats.counts = {0: 1, 2: 1}
    assert watch.due({0: 0, 2: 2}) == []
    for _ in range(int(10 + GRACE) + 2):
        clock[0] += 1.0
        beats.counts[0] += 1  # rank 0 alive (busy in its own code, say); member 2's count stays
        due = watch.due({0: 0, 2: 2})
        if due:
            break
    assert [slot for slot, _ in due] == [2] and "heartbeat stopped 16 s ago" in due[0][1]
    assert watch.due({0: 0}) == []  # at most once a second
    clock[0] += 100.0
    beats.counts[0] += 1
    assert watch.due({0: 0}) == []


def test_a_rank_with_no_heartbeat_yet_is_not_judged_and_one_past_the_end_is(clock):
    beats = _Beats()
    watch = Stragglers(beats, timeout=10.0, exit_timeout=30.0)
    for _ in range(60):  # member 1 is still importing torch: no heartbeat key yet
        clock[0] += 1.0
        assert watch.due({1: 1}) == []
    beats.counts[1], beats.finished = 5, True
    clock[0] += 1.0
    assert watch.due({1: 1}) == []
    clock[0] += 30.0 + GRACE + 1.0
    beats.counts[1] += 1  # its heartbeat goes on (stuck in I/O): stopped for the end it never reaches
    [(slot, why)] = watch.due({1: 1})
    assert slot == 1 and "after a member reached the end of the script" in why
