"""The watchdog at a thousand ranks: its requests to the store a tick, the store's CPU, how soon it names a fault.

What it measures
    ``--ranks`` simulated ranks against one real TCPStore, the store in a process of its own. Each rank is a
    TCPStore client of its own running autodist's own watchdog tick (``Watchdog._tick``: publish its status,
    read the verdict and the digest; on the reader, every status and the digest written): only the status
    is set by this script instead of a training loop, with a Python stack of the usual size while a rank
    waits. Ranks tick in rounds, each rank once a round, spread over the tick; every request is counted
    through the client, and the store process's CPU time read from /proc. Four states:

    healthy    every rank runs its own code and enters a gradient sync that completes within the tick
    straggler  rank N/2 lags in its own code (its heartbeat goes on); every other rank waits in the sync
    dead       rank N/2 stops publishing (killed); every other rank waits in the sync
    busy0      rank 0, the reader, evaluates alone; every other rank waits in the sync

    "before" is the design this replaced, request for request: every rank that has waited a tick reads every
    other status with three requests each (a check, a get, a check of its left/ key).

How to run
    python benchmarks/bench_watchdog.py                              # N = 100, 300, 1000, 2000; a few minutes
    python benchmarks/bench_watchdog.py --ranks 1000 --states healthy --seconds 600   # no false alarm in 10 min
    python benchmarks/bench_watchdog.py --quick                      # smoke run: 20 ranks, short states

How to read it
    "requests / tick" is what the store serves in one round of ticks (every rank once): 2 N + 2 for the
    reader design in every state. "store CPU" is the store thread's CPU time per round as a share of a
    core at one round a second (the real pace of the ticks), so it holds even where this machine could not
    drive the rounds that fast. "named after" is how many ticks after a line or verdict was due (the
    straggler waited for AUTODIST_TIMEOUT, the dead rank silent for it) the rank that says it printed it.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from autodist.faults.verdicts import Status
from autodist.faults.watchdog import Watchdog

STATES = ("healthy", "straggler", "dead", "busy0")
SYNC = "the gradient sync of step 300 of epoch 0"
STACK = "".join(f'  File "/home/user/train.py", line {100 + i}, in step_{i}\n    loss = model(x).sum()\n'
                for i in range(12))  # a waiting rank's stack as the watchdog publishes it: about 1 KB


class Counted:
    """A TCPStore client whose requests are counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.count = store, 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return value(*args, **kwargs)
        return counted if callable(value) else value


class Rank(Watchdog):
    """One simulated rank: autodist's watchdog, its status set by the state, what it says recorded."""

    def __init__(self, store: Any, rank: int, size: int, timeout: float, state: str, start: float) -> None:
        super().__init__(Counted(store), rank, size, timeout, threading.get_ident(), 1800.0,
                         "AUTODIST_BUSY_TIMEOUT=1800 s")
        self.status.host = f"host{rank // 8}"  # 8 ranks a host: most statuses come from other hosts
        self.state, self.start, self.said_at, self.found = state, start, [], []

    def _observe(self, now: float) -> None:
        st, waited = self.status, now - self.start
        lagging = self.state == "straggler" and self.rank == self.size // 2 or self.state == "busy0" and self.rank == 0
        if self.state == "healthy":
            waiting = (now * 2 + self.rank / self.size) % 1 > 0.8  # in the sync for the last 0.1 s of a 0.5 s step
            st.wait, st.wait_s = (SYNC, 0.05) if waiting else (None, 0.0)
        elif lagging:
            st.wait, st.wait_s = None, 0.0
        else:
            st.wait, st.wait_s = SYNC, waited
        st.at = None if st.wait else "train.py:216 in estimate_loss <- train.py:265 in <module>"
        st.stack = STACK if st.wait else None
        st.position = [0, 300, 1000]

    def _say(self, said: list) -> None:
        if said[0] != self.said:
            self.said = said[0]
            self.said_at.append((time.monotonic(), said[1]))

    def _decided(self, message: str) -> None:
        self.leaving = True
        self.found.append((time.monotonic(), message))

    def obey(self, verdict: str) -> None:
        self.leaving = True


class Before(Rank):
    """The design this replaced, request for request: a waiting rank reads each status with three requests."""

    def _tick(self) -> None:
        now = time.monotonic()
        self._observe(now)
        self.publish()
        if self.store.check(["verdict"]) and self.store.get("verdict"):
            self.leaving = True
        if self.status.wait and self.status.wait_s >= self.tick:
            for rank in range(self.size):
                if rank != self.rank and self.store.check([f"status/{rank}"]):
                    self.store.get(f"status/{rank}")
                    self.store.check([f"left/{rank}"])


def _host_store(port: Any, ready: Any) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    port.value = store.port
    ready.set()
    while True:
        time.sleep(3600)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def store_host() -> tuple[Any, int]:
    """A TCPStore in a process of its own (nothing else runs there): the process, and the store's port."""
    context = multiprocessing.get_context("spawn")
    port, ready = context.Value("i", 0), context.Event()
    host = context.Process(target=_host_store, args=(port, ready), daemon=True)
    host.start()
    ready.wait(60)
    return host, port.value


def measure(host: Any, clients: list[Any], state: str, design: str, seconds: float, timeout: float,
            drivers: int) -> dict:
    """One state with a rank per client: requests and store CPU per round, rounds' pace, when faults were named."""
    size = len(clients)
    kind = Before if design == "before" else Rank
    start = time.monotonic() + 1e6  # set below, once every rank is made
    ranks = [kind(dist.PrefixStore(f"{design}/{state}/", client), rank, size, timeout, state, start)
             for rank, client in enumerate(clients)]
    for key in ("verdict", "digest"):
        ranks[0].store.compare_set(key, "", "")
    for key in ("arrived", "left_count"):
        ranks[0].store.add(key, 0)
    for r in ranks:
        r._tick()  # every status published once, as at the start of a job
    start = time.monotonic()
    for r in ranks:
        r.start = start
    dead = size // 2 if state == "dead" else None
    tick = ranks[0].tick
    rounds, window = _drive(ranks, drivers, tick, seconds, dead, host.pid)
    said = [(t - start, r.rank, line) for r in ranks for t, line in r.said_at]
    found = [(t - start, r.rank, message) for r in ranks for t, message in r.found]
    named = None
    if state in ("straggler", "busy0") and said:
        named = (min(t for t, _, _ in said) - timeout) / tick
    if state == "dead" and found:
        named = (min(t for t, _, _ in found) - timeout) / tick  # it published last as the rounds began
    requests, cpu, period = window
    return {"size": size, "state": state, "design": design, "rounds": rounds, "requests": requests,
            "cpu": cpu / tick, "period": period, "named": named,
            "alarms": len(found) + len(said) if state == "healthy" else None,
            "said": said[:1], "found": found[:1]}


def _drive(ranks: list[Rank], drivers: int, tick: float, seconds: float, dead: int | None,
           store_pid: int) -> tuple[int, tuple[float, float, float]]:
    """Rounds of ticks until ``seconds`` pass or every rank left; (rounds, (requests, store CPU s, seconds)
    per round over the rounds after the first)."""
    start, rounds, marks = time.monotonic(), 0, []
    slices = [ranks[i::drivers] for i in range(drivers)]

    def run(part: list[Rank], began: float) -> None:
        for i, rank in enumerate(part):
            time.sleep(max(0.0, began + tick * i / len(part) - time.monotonic()))
            if rank.rank != dead and not rank.leaving:
                rank._tick()

    while time.monotonic() - start < seconds and not all(r.leaving for r in ranks if r.rank != dead):
        marks.append((sum(r.store.count for r in ranks), _cpu_seconds(store_pid), time.monotonic()))
        began = time.monotonic()
        threads = [threading.Thread(target=run, args=(part, began)) for part in slices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rounds += 1
        time.sleep(max(0.0, began + tick - time.monotonic()))
    marks.append((sum(r.store.count for r in ranks), _cpu_seconds(store_pid), time.monotonic()))
    first = marks[1] if len(marks) > 2 else marks[0]  # the first round read every status key into being
    steps = [tuple(b - a for a, b in zip(m0, m1)) for m0, m1 in zip(marks[1:], marks[2:])] or \
        [tuple(b - a for a, b in zip(marks[0], marks[-1]))]
    cpu = (marks[-1][1] - first[1]) / max(1, len(marks) - 1 - marks.index(first))  # the clock counts 10 ms steps
    return rounds, (statistics.median(s[0] for s in steps), cpu, statistics.median(s[2] for s in steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[100, 300, 1000, 2000])
    parser.add_argument("--before", type=int, nargs="+", default=[100, 300],
                        help="sizes at which the replaced design is measured too")
    parser.add_argument("--states", nargs="+", default=list(STATES), choices=STATES)
    parser.add_argument("--seconds", type=float, default=9.0, help="how long each state runs (at most)")
    parser.add_argument("--timeout", type=float, default=5.0, help="AUTODIST_TIMEOUT of the ranks (tick: 1 s)")
    parser.add_argument("--drivers", type=int, default=8, help="threads that tick the ranks")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 ranks, short states")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.before, args.seconds, args.timeout = [20], [20], 2.0, 1.0
    print("| design | ranks | state | requests / tick | 2N+2 | store CPU, % of a core | rounds, s each | "
          "named after, ticks | false alarms |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for size in args.ranks:
        host, port = store_host()
        clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
                   for _ in range(size)]  # a connection of its own for each rank
        for design in ("reader", "before") if size in args.before else ("reader",):
            for state in args.states:
                if design == "before" and state in ("healthy", "dead"):
                    continue  # it read nothing while no rank waited; a dead rank reads as the straggler
                m = measure(host, clients, state, design, args.seconds, args.timeout, args.drivers)
                named = "-" if m["named"] is None else f"{m['named']:.1f}"
                alarms = "-" if m["alarms"] is None else str(m["alarms"])
                print(f"| {design} | {size} | {state} | {m['requests']:.0f} | {2 * size + 2} | {100 * m['cpu']:.1f} | "
                      f"{m['rounds']}, {m['period']:.2f} | {named} | {alarms} |", flush=True)
                if design == "reader":
                    failed |= m["requests"] > 2 * size + 2 or bool(m["alarms"])
                    failed |= state in ("straggler", "dead", "busy0") and args.seconds > args.timeout + 3 and \
                        (m["named"] is None or m["named"] > 3)
        del clients
        host.kill()
    print("\nall within the targets" if not failed else "\nSOME FIGURE MISSED ITS TARGET")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
