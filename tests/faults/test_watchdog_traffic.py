"""The watchdog's requests to the store grow as the ranks: each rank two a tick, the reader two more (a real
TCPStore; ranks simulated by Watchdog objects in this process, their statuses set by the test)."""
from __future__ import annotations

import datetime
import re
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from autodist.faults import watchdog
from autodist.faults.reader import STALE_TICKS, Reader
from autodist.faults.verdicts import Status
from autodist.faults.watchdog import Watchdog

TIMEOUT = 0.5  # AUTODIST_TIMEOUT of these simulated ranks: a tick of 0.1 s


class Counted:
    """The store, counting the requests the watchdog sends it."""

    def __init__(self, store: Any) -> None:
        self.store, self.count = store, 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return value(*args, **kwargs)
        return counted if callable(value) else value


class Simulated(Watchdog):
    """A rank whose status the test sets; what it would print or how it would leave is recorded instead."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        super().__init__(Counted(store), rank, size, TIMEOUT, threading.get_ident(), 60.0, "AUTODIST_BUSY_TIMEOUT=60 s")
        self.status.host = "sim"
        self.wait: tuple[str, float] | None = None  # (collective, monotonic start) while it waits
        self.lines: list[str] = []
        self.verdicts: list[str] = []

    def _observe(self, now: float) -> None:
        st = self.status
        st.wait, st.wait_s = (self.wait[0], now - self.wait[1]) if self.wait else (None, 0.0)
        st.at = None if self.wait else "train.py:88 in estimate_loss"

    def _say(self, said: list) -> None:
        if said[0] != self.said:
            self.said = said[0]
            self.lines.append(said[1])

    def _decided(self, message: str) -> None:
        self.leaving = True
        self.verdicts.append(message)

    def obey(self, verdict: str) -> None:
        self.leaving = True
        self.verdicts.append(f"stopped because rank {verdict.partition(chr(10))[0]} found")


def _ranks(size: int) -> list[Simulated]:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    store = dist.PrefixStore("watchdog/", server)
    for key in ("verdict", "digest"):
        store.compare_set(key, "", "")
    for key in ("arrived", "left_count"):
        store.add(key, 0)
    ranks = [Simulated(store, r, size) for r in range(size)]
    ranks[0]._server = server  # held: the store lives as long as the ranks
    return ranks


def _round(ranks: list[Simulated], skip: tuple[int, ...] = ()) -> int:
    """Every rank (but ``skip``) ticks once: the requests they sent."""
    before = sum(r.store.count for r in ranks)
    for rank in ranks:
        if rank.rank not in skip and not rank.leaving:
            rank._tick()
    return sum(r.store.count for r in ranks) - before


@pytest.mark.parametrize("size", [4, 64, 512])
def test_a_tick_costs_two_requests_a_rank_and_two_more_for_the_reader(size):
    ranks = _ranks(size)
    _round(ranks)  # the reader makes every status key once
    assert _round(ranks) == 2 * size + 2
    start = time.monotonic()
    for rank in ranks[1:]:  # rank 0 busy in its own code, every other rank waiting for it
        rank.wait = ("the gradient sync of batch 3 of epoch 0", start)
    assert [_round(ranks) for _ in range(3)] == [2 * size + 2] * 3
    assert ranks[0].digest.by == 0 and len(ranks[0].digest_text) < 1000  # small, whatever the ranks


def test_the_lowest_waiting_rank_says_whom_it_waits_for_once_a_line_is_due():
    ranks = _ranks(4)
    start = time.monotonic() - TIMEOUT  # waiting for AUTODIST_TIMEOUT already
    for rank in ranks[1:]:
        rank.wait = ("the gradient sync of batch 3 of epoch 0", start)
    _round(ranks)
    _round(ranks)
    assert [len(r.lines) for r in ranks] == [0, 1, 0, 0]
    assert re.match(r"rank 1 has waited \d s in the gradient sync of batch 3 of epoch 0 for rank 0, which is in its own "
                    r"code \(0 gradient syncs done\) at train.py:88 in estimate_loss: its heartbeat goes on",
                    ranks[1].lines[0]), ranks[1].lines
    _round(ranks)
    assert len(ranks[1].lines) == 1  # said once, until the next is due a line_every later


def test_the_reader_finds_the_verdict_for_the_rank_that_waited_longest():
    ranks = _ranks(3)
    _round(ranks)
    ranks[1].wait = ("the gradient sync of batch 3 of epoch 0", time.monotonic())
    deadline = time.monotonic() + 20 * TIMEOUT
    while not ranks[1].verdicts and time.monotonic() < deadline:  # rank 2 silent from here on
        time.sleep(ranks[0].tick)
        _round(ranks, skip=(2,))
    assert re.match(r"rank 1 has waited \d s in the gradient sync of batch 3 of epoch 0 for the other ranks: rank 0 is "
                    r"in its own code .*; rank 2 sent no heartbeat for \d s", ranks[1].verdicts[0]), ranks[1].verdicts
    assert ranks[0].verdicts == ["stopped because rank 1 found"]


def test_a_successor_reads_when_the_readers_digest_grows_old():
    ranks = _ranks(4)
    _round(ranks)
    _round(ranks)
    assert ranks[0].digest.successors == [1, 2, 3]
    deadline = time.monotonic() + 20 * STALE_TICKS * ranks[0].tick
    while ranks[1].digest.by == 0 and time.monotonic() < deadline:  # rank 0 frozen (its thread, not the store)
        time.sleep(ranks[0].tick)
        _round(ranks, skip=(0,))
    assert ranks[1].digest.by == 1 and ranks[2].digest.by == 1
    assert ranks[1].reader.silent[0] >= STALE_TICKS * ranks[0].tick  # counted from rank 0's last digest
    before = [r.store.count for r in ranks]
    _round(ranks, skip=(0,))
    assert [r.store.count - b for r, b in zip(ranks, before)] == [0, 4, 2, 2]


def test_ranks_that_left_are_not_read():
    ranks = _ranks(8)
    _round(ranks)
    watchdog._watchdog = ranks[3]
    try:
        watchdog.rank_left(5, "its server went on without it")
    finally:
        watchdog._watchdog = None
    _round(ranks, skip=(5,))
    assert ranks[0].reader.left == {5} and 5 not in ranks[0].reader.statuses
    assert _round(ranks, skip=(5,)) == 2 * 7 + 2  # its count did not move: no rank is looked up one by one


def test_the_longest_epoch_is_kept_in_one_key():
    ranks = _ranks(2)
    store = ranks[0].store.store
    for steps, rank in [(5, 1), (7, 3), (6, 0), (7, 2)]:
        watchdog._raise_to(store, "epoch/x/0", 4, steps, rank, 100 + rank)
    assert store.get("epoch/x/0") == b"4 7 2 102"
    watchdog._raise_to(store, "epoch/x/0", 2, 9, 0, 100)  # a rank behind, in epoch 2: it leaves epoch 4's
    assert store.get("epoch/x/0") == b"4 7 2 102"
    watchdog._raise_to(store, "epoch/x/0", 6, 3, 1, 101)  # epoch 6 replaces it, however short
    assert store.get("epoch/x/0") == b"6 3 1 101"


def test_a_loader_run_many_times_keeps_two_keys_and_still_finds_a_longer_rank():
    """An evaluation loader run every K steps begins an epoch each time: before, a key per pass stayed in the
    store for the rest of the job. Now two a loader; ranks one epoch apart do not mix theirs."""
    ranks = _ranks(2)
    store = ranks[0].store.store
    watchdog._watchdog = ranks[0]
    try:
        watchdog.epoch_begins("eval", 0, 3, 30)
        before = store.num_keys()
        for epoch in range(50):
            watchdog.epoch_begins("eval", epoch, 3, 30)
            watchdog.data_ended("eval", epoch, 3, 30)
        assert store.num_keys() == before + 1  # epoch 1's slot; before: a key per epoch, 49 more
        watchdog._raise_to(store, watchdog._epoch_key("eval", 50), 50, 4, 1, 40)  # rank 1 has more in epoch 50
        watchdog.epoch_begins("eval", 50, 3, 30)
        with pytest.raises(ValueError, match="rank 0's data ended after batch 3 of epoch 50, but rank 1's has 4"):
            watchdog.data_ended("eval", 50, 3, 30)
        watchdog.data_ended("eval", 52, 3, 30)  # slot 0 holds epoch 50's: not compared with epoch 52
    finally:
        watchdog._watchdog = None


def test_a_digest_names_at_most_16_ranks_that_left_and_counts_them_all():
    ranks = _ranks(40)
    _round(ranks)
    watchdog._watchdog = ranks[1]
    try:
        for rank in range(10, 40):
            watchdog.rank_left(rank, "its server went on without it")
    finally:
        watchdog._watchdog = None
    _round(ranks, skip=tuple(range(10, 40)))
    digest = ranks[0].digest
    assert digest.left == list(range(10, 26)) and digest.left_count == 30
    assert len(digest.dumps()) < 1000  # before: every rank that left, in every digest, read by every rank a tick


def test_reading_before_every_rank_published_names_those_that_did_not():
    ranks = _ranks(3)
    reader = Reader(ranks[0].store, 0, 3, TIMEOUT, 0.1, 60.0, "B")
    ranks[1]._tick()
    statuses, _ = reader.read(Status(rank=0, host="sim"))
    assert statuses[1] is not None and statuses[2] is None
