"""The fence in shared memory: nobody passes before every rank arrived, a dead rank is an error, gloo elsewhere."""
from __future__ import annotations

import mmap
import platform
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from autodist.runtime import shared_fence
from autodist.runtime.shared_slots import shared_slots

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _rounds(rounds: int, late_rank: int) -> tuple[str, list[str], float, float]:
    """Each round every rank writes the round into its slot, passes the fence, reads every slot, and passes the
    fence again; ``late_rank`` arrives 0.3 s late at the first fence. What went wrong, if anything; and when this
    rank arrived at and left that fence."""
    rank, size = dist.get_rank(), dist.get_world_size()
    shared = shared_slots([torch.zeros(1000, dtype=torch.float64)], None, "the fence test")
    assert shared is not None
    slots, fence = shared.slots[0], shared.fence
    wrong = []
    for r in range(1, rounds + 1):
        if r == 1 and rank == late_rank:
            time.sleep(0.3)
        if r == 1:
            arrived = time.time()
        slots[rank].fill_(r)
        fence.wait()
        if r == 1:
            left = time.time()
        seen = [slot[-1].item() for slot in slots] + [slot[0].item() for slot in slots]
        if seen != [r] * 2 * size:
            wrong.append(f"round {r}: rank {rank} saw {seen}")
        fence.wait()  # every rank read: the slots may be written again
    return fence.name, wrong[:3], arrived, left


@pytest.mark.parametrize("size", [2, 3])
def test_no_rank_passes_the_fence_before_every_rank_wrote(ranks, size):
    results = ranks(size, _rounds, 2000, size - 1)
    late_arrival = results[-1][2]
    for name, wrong, _, left in results:
        assert name == ("shared memory" if X86 else "gloo")
        assert wrong == []
        assert left >= late_arrival  # the others waited for the late rank


def _file(size: int) -> mmap.mmap:
    return mmap.mmap(-1, shared_fence.fence_bytes(size))


def test_a_dead_rank_is_an_error_not_a_wait():
    mapping = _file(2)
    shared_fence.announce(mapping, 0, 0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    lines = memoryview(mapping).cast("q")
    lines[shared_fence.WORDS + shared_fence.PID] = child.pid  # rank 1: a process that ends without arriving
    try:
        fence = shared_fence.SharedFence(mapping, 0, 0, 2, world_ranks=[4, 6])  # a group of world ranks 4 and 6
        start = time.monotonic()
        with pytest.raises(shared_fence.PeerGone, match=rf"rank 1 of the group \(process {child.pid} of this machine\)"
                                                          r" is gone") as gone:
            fence.wait()  # the child is a zombie until waited for: dead all the same
        assert time.monotonic() - start < 5
        assert gone.value.rank == 6  # its rank in the world: what the watchdog names
    finally:
        child.wait()
        lines.release()
        fence.close()


def test_a_rank_that_arrives_lets_the_other_pass():
    mapping = _file(2)
    shared_fence.announce(mapping, 0, 0)
    shared_fence.announce(mapping, 0, 1)
    mine, theirs = shared_fence.SharedFence(mapping, 0, 0, 2), shared_fence.SharedFence(mapping, 0, 1, 2)
    lines = memoryview(mapping).cast("q")
    lines[shared_fence.WORDS + shared_fence.COUNT] = 1  # rank 1 arrived once already
    mine.wait()
    assert mine.count == 1 and lines[shared_fence.COUNT] == 1
    lines.release()
    mine.close()
    theirs.close()


def test_a_long_wait_looks_less_often_and_sees_the_arrival_soon(monkeypatch):
    """Rank 1 arrives after 1.5 s: rank 0 waited looking less and less often (a look every 50 microseconds, about
    14,000 looks and 300 reads of /proc here, cost it 8-15% of a core; backing off, 2-3%), and left soon after the
    arrival (within a twentieth of the wait, plus a loaded machine's scheduling). Looks are counted, not CPU
    time: a busy machine makes fewer of them, never more."""
    mapping = _file(2)
    shared_fence.announce(mapping, 0, 0)
    shared_fence.announce(mapping, 0, 1)  # this process: alive
    fence = shared_fence.SharedFence(mapping, 0, 0, 2)
    lines = memoryview(mapping).cast("q")
    looks, checks, arrived = [0], [0], []
    sleep, alive = time.sleep, shared_fence._alive

    def counted_sleep(seconds: float) -> None:
        looks[0] += 1
        sleep(seconds)

    def counted_alive(pid: int) -> bool:
        checks[0] += 1
        return alive(pid)
    monkeypatch.setattr(shared_fence, "time", SimpleNamespace(sleep=counted_sleep, monotonic=time.monotonic))
    monkeypatch.setattr(shared_fence, "_alive", counted_alive)

    def arrive() -> None:
        sleep(1.5)
        arrived.append(time.monotonic())
        lines[shared_fence.WORDS + shared_fence.COUNT] = 1
    other = threading.Thread(target=arrive)
    start = time.monotonic()
    other.start()
    fence.wait()
    left = time.monotonic()
    other.join()
    lines.release()
    fence.close()
    waited = left - start
    assert looks[0] < 1000 * waited and checks[0] < 100 * waited, (looks, checks, waited)
    assert left - arrived[0] < 0.05 * waited + 0.5, (left - arrived[0], waited)


def _chosen() -> str:
    return shared_fence.choose(_announced(), 0, None).name


def _announced() -> mmap.mmap:
    """A file every rank announced itself in (this test's stand-in for one shared file: the lines of the other
    ranks are copied in through gloo)."""
    mapping = _file(dist.get_world_size())
    shared_fence.announce(mapping, 0, dist.get_rank())
    mine = torch.frombuffer(mapping, dtype=torch.int64).clone()
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    lines = memoryview(mapping).cast("q")
    for r, theirs in enumerate(every):
        words = slice(r * shared_fence.WORDS, (r + 1) * shared_fence.WORDS)
        lines[words] = memoryview(theirs.numpy().tobytes()).cast("q")[words]
    lines.release()
    return mapping


def test_the_shared_fence_only_where_a_store_orders_the_stores_before_it(ranks):
    assert ranks(2, _chosen) == ["shared memory" if X86 else "gloo"] * 2


def _chosen_elsewhere(machine: str, namespace: int | None) -> str:
    """The fence chosen on processor ``machine``, with every rank's pid namespace ``namespace`` (None: its own)."""
    real_machine, real_namespace = shared_fence.platform.machine, shared_fence._pid_namespace
    shared_fence.platform.machine = lambda: machine
    if namespace is not None:
        shared_fence._pid_namespace = lambda: namespace
    try:
        return _chosen()
    finally:
        shared_fence.platform.machine, shared_fence._pid_namespace = real_machine, real_namespace


@pytest.mark.parametrize("machine, namespace", [("aarch64", None), ("ppc64le", None), ("x86_64", 0)])
def test_other_processors_or_unknown_processes_take_gloos_fence(ranks, machine, namespace):
    assert ranks(2, _chosen_elsewhere, machine, namespace) == ["gloo", "gloo"]
