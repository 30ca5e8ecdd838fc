"""The watchdog's traffic on real processes while ranks wait for a busy rank 0, counted request by request.

What it measures
    ``--ranks`` real processes (torchrun, gloo, CPU), a tiny model under ``parallelize``, AUTODIST_TIMEOUT set
    to ``--timeout``. After a first step, every rank's watchdog store is wrapped in a counter of its requests
    (set, get, check, multi_get, add: each one request to the store); then rank 0 stays busy in its own Python
    code for ``--busy`` seconds while every other rank waits for it in the gradient sync, as a rank saving a
    checkpoint or evaluating alone makes them wait. The job must finish (the busy-rank rule waits for rank 0),
    and the requests each rank sent over the wait are divided by its seconds; the last column names the ranks
    that printed a progress line naming rank 0. (``bench_watchdog.py`` simulates a thousand ranks.)

How to run
    python benchmarks/bench_watchdog_job.py --ranks 8           # about 20 s
    python benchmarks/bench_watchdog_job.py --ranks 16
    python benchmarks/bench_watchdog_job.py --quick             # smoke run: 2 ranks, a short wait

How to read it
    "all ranks" is what the store serves a second; "a waiting rank" what one rank that waits sends (two a
    tick); rank 0, the reader, sends two more. Growing linearly with the ranks, the first doubles with them
    and the second stays flat; growing as N squared, the first quadruples and the second doubles.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist

import autodist
from autodist.faults import watchdog

REQUESTS = ("set", "get", "check", "multi_get", "add", "append", "compare_set", "delete_key")


class Counted:
    """A store whose requests are counted (each method call above is one request to the store)."""

    def __init__(self, store: Any) -> None:
        self.store, self.count = store, 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.store, name)
        if name not in REQUESTS:
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return value(*args, **kwargs)
        return counted


def worker(args: argparse.Namespace) -> None:
    model, _ = autodist.parallelize(torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()  # a first step: buckets built, every status published
    dog = watchdog.running()
    assert dog is not None
    counted = dog.store = Counted(dog.store)
    if dog.reader is not None:  # the reader's own requests (every status, the digest) counted too
        dog.reader.store = counted
    lines: list[str] = []
    heard = logging.Handler()
    heard.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autodist").addHandler(heard)
    rank = dist.get_rank()
    start = time.monotonic()
    if rank == 0:
        end = start + args.busy
        while time.monotonic() < end:  # busy in its own code, holding the others in the sync below
            sum(i * i for i in range(1000))
    model(x).sum().backward()  # the others wait here for rank 0
    seconds = time.monotonic() - start
    requests = counted.count
    dog.store = counted.store
    if dog.reader is not None:
        dog.reader.store = counted.store
    logging.getLogger("autodist").removeHandler(heard)
    named = any("for rank 0, which is in its own code" in line for line in lines)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (requests, seconds, named))
    if rank == 0:
        size = len(everyone)
        total = sum(r / s for r, s, _ in everyone)
        waiting = [r / s for r, s, _ in everyone[1:]]
        speakers = [r for r, (_, _, said) in enumerate(everyone) if said]
        print(f"\n{size} ranks, rank 0 busy {args.busy:g} s, AUTODIST_TIMEOUT={args.timeout:g} s\n")
        print("| ranks | all ranks, requests/s | a waiting rank, requests/s (median) | rank 0 (busy, the reader) | "
              "rank 0 named by |")
        print("|---|---|---|---|---|")
        print(f"| {size} | {total:.1f} | {sorted(waiting)[len(waiting) // 2]:.1f} | "
              f"{everyone[0][0] / everyone[0][1]:.1f} | {', '.join(f'rank {r}' for r in speakers) or 'NO RANK'} |")


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=8, ranks_option=True)
    parser.add_argument("--busy", type=float, default=12.0, help="seconds rank 0 stays in its own code")
    parser.add_argument("--timeout", type=float, default=5.0, help="AUTODIST_TIMEOUT for the run")
    args = parser.parse(quick={"ranks": 2, "busy": 2.0, "timeout": 1.0})
    os.environ["AUTODIST_TIMEOUT"] = f"{args.timeout:g}"  # the ranks inherit it
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
