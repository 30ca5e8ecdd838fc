"""The end's deadline (runtime.ending._Bound): a rank arriving just as it expires is not a missing rank.

The deadline asks the meeting twice: whether the missing ranks are busy (busy_line), then who is missing. A rank
arriving between the two questions was once reported as "every rank arrived" and every rank stopped with status 1
(seen once in the fault matrix). The questions are asked here of a meeting that answers like that, in one process.
"""
from __future__ import annotations

import pytest

from autodist.runtime import ending


class _ArrivedMeanwhile:
    """A meeting whose last missing rank arrives between busy_line (give up) and missing (nobody is missing)."""

    busy_words = "AUTODIST_BUSY_TIMEOUT=9 s"

    def __init__(self, missing: str) -> None:
        self.who, self.given_up = missing, []

    def arrive(self) -> None:
        pass

    def busy_line(self, waited: float) -> str | None:
        return None

    def missing(self) -> str:
        return self.who

    def give_up(self, message: str) -> None:
        self.given_up.append(message)


def test_a_rank_arriving_at_the_deadline_ends_the_meeting_normally():
    meeting = _ArrivedMeanwhile(missing="")
    bound = ending._Bound(meeting, 30.0)
    bound._expired()  # not started: the deadline's questions asked now, in this thread
    try:
        assert meeting.given_up == []
        assert bound.timer.is_alive()  # the deadline is armed again, in case the meeting still does not end
    finally:
        bound.cancel()
    assert not bound.timer.is_alive()


@pytest.fixture
def left(monkeypatch) -> list[int]:
    """The exit statuses the deadline leaves with (recorded, not left with), as rank 1."""
    codes: list[int] = []
    monkeypatch.setattr(ending, "leave", lambda code, message=None: codes.append(code))
    monkeypatch.setattr(ending.dist, "get_rank", lambda: 1)
    return codes


def test_a_missing_rank_at_the_deadline_is_named(left):
    meeting = _ArrivedMeanwhile(missing="rank 0 is in its own code at train.py:12")
    bound = ending._Bound(meeting, 30.0)
    bound._expired()
    assert meeting.given_up == ["rank 1 reached the end of its script and waited 0 s for the others: rank 0 is in "
                                "its own code at train.py:12 (AUTODIST_EXIT_TIMEOUT=30 s; raise it if a rank "
                                "legitimately finishes this much later)"]
    assert left == [1]
    bound.cancel()


def test_a_meeting_that_does_not_end_though_every_rank_arrived_is_given_up_the_second_time(left):
    meeting = _ArrivedMeanwhile(missing="")
    bound = ending._Bound(meeting, 30.0)
    bound._expired()
    assert meeting.given_up == [] and bound.timer.is_alive()
    bound.timer.cancel()
    bound._expired()  # armed again once: the second time it gives up, saying so
    assert len(meeting.given_up) == 1 and "every rank said it arrived, yet the meeting did not end" in \
        meeting.given_up[0], meeting.given_up
    assert left == [1]
    bound.cancel()
