"""The cost of a stream: the same samples as a map-style Dataset and as an IterableDataset, each through
``parallelize``'s DataLoader, step times side by side.

What it measures
    Two ranks (torchrun, gloo, CPU), the benchmarks' MLP 3072-2048-2048-10, SGD, global batches of
    ``--batch``. The data: ``--samples`` random samples, held in memory, given (a) as a ``TensorDataset``
    (each rank collates only its rows of every global batch) and (b) as an ``IterableDataset`` yielding the
    same samples (every rank reads and collates every sample, keeps its rows, and takes a CRC-32 of the batch).
    A timed step is the whole step including fetching the batch, in interleaved blocks (timing.py).

How to run
    python benchmarks/bench_stream.py            # a minute or two on 2 cores
    python benchmarks/bench_stream.py --quick    # smoke run of seconds, timing nothing

How to read it
    The ratio of median steps, stream / map-style, is what reading every sample on every rank costs here;
    beside it the bytes a rank collates per step in each (the stream's are the whole global batch's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Iterator

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from workload import IN_FEATURES, build_model  # benchmarks/workload.py

import autodist

RANKS = 2


class Samples(IterableDataset):
    """The tensors' samples as a stream, in order."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.x, self.y)


def _endless(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def run_worker(args: argparse.Namespace) -> None:
    world = autodist.init()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.samples, IN_FEATURES, generator=g), torch.randint(0, 10, (args.samples,), generator=g)
    steps = {}
    for name, data in (("map-style", TensorDataset(x, y)), ("stream", Samples(x, y))):
        model, loader = autodist.parallelize(build_model(seed=0), DataLoader(data, batch_size=args.batch))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        batches = _endless(loader)

        def step(model=model, optimizer=optimizer, batches=batches) -> float:
            start = time.perf_counter()
            xb, yb = next(batches)
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            return time.perf_counter() - start

        steps[name] = step
    times, paired = timing.interleave(steps, args.steps, args.rounds, args.warmup, before_block=dist.barrier)
    if world.rank == 0:
        row = 4 * (IN_FEATURES + 1)
        print(f"2 ranks ({world.backend}, cpu), global batch {args.batch}, {args.samples} samples", flush=True)
        for name, ts in times.items():
            rows = args.batch if name == "stream" else args.batch // world.size
            print(timing.describe(name, ts), f"  collated per step {rows * row / 2**20:.2f} MiB", flush=True)
        ratio = statistics.median(times["stream"]) / statistics.median(times["map-style"])
        print(f"  ratio of medians stream/map-style {ratio:.3f}; paired {statistics.median(paired):.3f}", flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True)
    parser.blocks(steps=5, rounds=10, warmup=3)
    parser.add_argument("--batch", type=int, default=128, help="global batch, split over the 2 ranks")
    parser.add_argument("--samples", type=int, default=4096, help="samples in the data")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "samples": 512})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
