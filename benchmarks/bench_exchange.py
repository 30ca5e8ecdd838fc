"""Summing one bucket over the ranks of one machine: shared memory (autodist.dp.exchange) against gloo's all-reduce.

What it measures
    Ranks started by torchrun on this machine (2 by default, gloo, 1 thread
    each). For each size, one bucket of float32 is summed again and again
    both ways, alternating blocks of each, the order flipping every round: a
    timed operation is what gradient sync does with a full bucket, from the
    gradient (a separate tensor) to the sum in the bucket:
      shared memory  copy the gradient into the bucket (this rank's slot), then
                     ``finish`` (a one-number all-reduce, this rank's part of the
                     sum written into every rank's slot, another);
      gloo           copy the gradient into the bucket, then ``all_reduce`` it.
    Every result is checked against the sum of the ranks' gradients.

How to run
    python benchmarks/bench_exchange.py                 # 2 ranks, about half a minute
    python benchmarks/bench_exchange.py --ranks 3 --sizes 1,10,40
    python benchmarks/bench_exchange.py --quick          # smoke run of seconds, timing nothing

How to read it
    Per size, the median milliseconds of each and the ratio shared memory /
    gloo (lower is better). Run on an idle machine: the ranks share its cores.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist

import autodist
from autodist.dp import exchange


def timed(ex: exchange.Exchange, flat: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    flat.copy_(grad)  # packing
    ex.send(0, flat)
    ex.finish()
    return time.perf_counter() - start


def measure(mb: float, rounds: int, block: int) -> tuple[float, float]:
    """Median seconds of (shared memory, gloo) for a bucket of ``mb`` MB on every rank."""
    n = int(mb * 1e6 / 4)
    grad = torch.full((n,), float(dist.get_rank() + 1))
    want = float(sum(range(1, dist.get_world_size() + 1)))
    flats = {"shared memory": torch.zeros(n), "gloo": torch.zeros(n)}
    chosen = exchange.choose([flats["shared memory"]], None)
    assert isinstance(chosen, exchange.SharedSum), "the ranks could not share memory on this machine"
    flats["shared memory"] = chosen.place(0, flats["shared memory"])  # the bucket lives in shared memory
    ways = {"shared memory": chosen, "gloo": exchange.AllReduce([flats["gloo"]], None)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            dist.barrier()
            times[name] += [timed(ways[name], flats[name], grad) for _ in range(block)]
            assert flats[name][0].item() == want and flats[name][-1].item() == want, name
    return statistics.median(times["shared memory"]), statistics.median(times["gloo"])


def run_worker(args: argparse.Namespace) -> None:
    autodist.init(backend="gloo")  # the group it starts, it ends at exit while the interpreter is whole
    rows = []
    for mb in args.sizes:
        shared, gloo = measure(mb, args.rounds, args.block)
        rows.append(f"| {mb:g} | {1e3 * shared:.2f} | {1e3 * gloo:.2f} | {shared / gloo:.3f} |")
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, gloo, 1 thread each; {args.rounds} rounds of {args.block} sums "
              f"each way per size\n")
        print("\n".join(["| MB per rank | shared memory ms | gloo all-reduce ms | shared / gloo |",
                         "|---|---|---|---|", *rows]), flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.add_argument("--sizes", type=lambda t: [float(v) for v in t.split(",")], default=[0.1, 1, 2.8, 10, 40],
                        help="comma-separated bucket sizes in MB (default 0.1,1,2.8,10,40)")
    parser.add_argument("--rounds", type=int, default=10, help="blocks of sums each way per size")
    parser.add_argument("--block", type=int, default=5, help="sums per block")
    args = parser.parse(quick={"sizes": [0.1, 1], "rounds": 2, "block": 2})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
