"""The watchdog's requests to the store: a waiting rank reads every other rank's status in a few requests,
whatever the number of ranks (a real TCPStore; the statuses published as the ranks publish them)."""
from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch.distributed as dist

from autodist.faults.verdicts import Status
from autodist.faults.watchdog import Watchdog


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


def _watching(size: int, left: tuple[int, ...] = ()) -> tuple[Watchdog, Counted]:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    store = dist.PrefixStore("watchdog/", server)
    for rank in range(1, size):
        store.set(f"status/{rank}", Status(rank=rank, seq=3, host="h").dumps())
    for rank in left:  # as watchdog.rank_left writes it
        store.set(f"left/{rank}", "its server went on without it")
        store.add("left_count", 1)
    counted = Counted(store)
    dog = Watchdog(counted, 0, size, 5.0, threading.get_ident(), 5.0, "AUTODIST_BUSY_TIMEOUT=5 s")
    dog._server = server  # held: the store lives as long as the watchdog
    return dog, counted


@pytest.mark.parametrize("size", [4, 64, 512])
def test_a_waiting_rank_reads_every_status_in_three_requests(size):
    dog, counted = _watching(size)
    peers = dog.peers()
    assert sorted(peers) == list(range(1, size)) and all(s.seq == 3 for s in peers.values())
    assert counted.count == 3  # the count of ranks that left, a check and a multi_get of the statuses
    dog.peers()
    assert counted.count == 6


def test_a_rank_that_left_is_found_once_and_not_read_again():
    dog, counted = _watching(8, left=(5,))
    assert 5 not in dog.peers() and dog.left == {5}
    before = counted.count
    assert 5 not in dog.peers()
    assert counted.count - before == 3  # its count did not move: no rank is looked up one by one


def test_before_every_rank_published_the_others_are_read_one_by_one():
    dog, counted = _watching(4)
    dog.store.store.delete_key("status/3")  # rank 3 has not published yet
    peers = dog.peers()
    assert peers[3] is None and peers[1].seq == 3
