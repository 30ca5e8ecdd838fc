"""torch.compile on a parallelized model: compiled autodist against compiled DDP, step times in one run.

What it measures
    An MLP of ``--layers`` Linear layers of ``--width`` (float32, SGD), ``--batch`` rows per rank, on 2 CPU
    ranks (gloo), four contenders built in the same processes and timed in interleaved blocks of steps:

    * ``autodist``: ``parallelize`` (data parallel), uncompiled;
    * ``autodist compiled``: the same, then ``torch.compile(model, backend=--backend)``;
    * ``DDP``: ``DistributedDataParallel``, uncompiled;
    * ``DDP compiled``: ``torch.compile(ddp_model)``, whose graph dynamo splits at DDP's bucket boundaries.

    Each contender's graph breaks (``torch._dynamo`` counters) are counted while it compiles; the medians of
    the step times and their ratios (compiled autodist / compiled DDP) are printed.

How to run
    python benchmarks/bench_compile.py                  # inductor; a few minutes on 2 cores, most of it compiling
    python benchmarks/bench_compile.py --quick          # smoke run: aot_eager, tiny model, a few steps
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import Any

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_sharded import mlp  # benchmarks/bench_sharded.py: the same MLP
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autodist

CONTENDERS = ("autodist", "autodist compiled", "DDP", "DDP compiled")


def contender(name: str, args: argparse.Namespace, dataset) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(model, optimizer, this rank's endless batches) for ``name``: autodist's from the DataLoader parallelize
    returns (its batches carry their share, which a compiled forward counts by), DDP's from a DistributedSampler."""
    loader = DataLoader(dataset, batch_size=2 * args.batch)
    if name.startswith("autodist"):
        model, loader = autodist.parallelize(mlp(args), loader)
    else:
        autodist.init()
        model = DistributedDataParallel(mlp(args))
        loader = DataLoader(dataset, batch_size=args.batch, sampler=DistributedSampler(dataset, shuffle=False))
    if name.endswith("compiled"):
        model = torch.compile(model, backend=args.backend)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), itertools.chain.from_iterable(
        itertools.repeat(loader))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Any) -> float:
    x, y = next(batches)
    start = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    n = 2 * args.batch * 8
    dataset = TensorDataset(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    steps, first = {}, {}
    for name in CONTENDERS:
        model, optimizer, batches = contender(name, args, dataset)
        counters.clear()
        start = time.perf_counter()
        _step(model, optimizer, batches)  # a compiled one compiles here
        first[name] = (sum(counters["graph_break"].values()), time.perf_counter() - start)
        steps[name] = (lambda m=model, o=optimizer, b=batches: _step(m, o, b))
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    if dist.get_rank() == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"\n2 ranks, MLP of {args.layers} x {args.width}, {args.batch} rows per rank, backend "
              f"{args.backend}\n")
        print("| contender | graph breaks | first step, compiling (s) | step (ms) | vs DDP compiled |")
        print("|---|---|---|---|---|")
        for name in CONTENDERS:
            print(f"| {name} | {first[name][0]} | {first[name][1]:.1f} | {1e3 * medians[name]:.2f} | "
                  f"{medians[name] / medians['DDP compiled']:.3f} |")
        print("\nstep times:\n" + "\n".join(timing.describe(name, t, 18) for name, t in times.items()))


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")
    args = parser.parse(quick={"layers": 2, "width": 64, "steps": 2, "rounds": 2, "warmup": 1,
                               "backend": "aot_eager"})
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
