"""A model whose replicated Adam training state does not fit the machine, trained fully sharded on 2 ranks.

What it shows
    An MLP of ``--layers`` Linear layers of ``--width`` (default 14 x 8192: 940 M parameters, float32,
    Adam). Replicated data parallelism holds 16 bytes per parameter on each rank (parameters, gradients,
    two Adam moments): 15 GB a rank, 30 GB for the pair, more than a 24 GiB machine has. Fully sharded
    (``shard="parameters"``, each Linear layer a block) each rank holds 1/2 of that plus the blocks in use.

    Each rank is given half of ``--machine-gib`` (default 24) as its address-space limit
    (``RLIMIT_AS``), so that the run that cannot fit fails inside its own processes with an allocation
    error instead of driving the machine into swap or its OOM killer. Two runs, one after the other:

    * ``shard="parameters"``: ``--steps`` steps; each rank prints its step times, the bytes it holds
      between steps by kind (``autodist.memory``: parameters, gradients, optimizer state, autodist's
      buffers, its share of the shared memory), and its peak resident memory;
    * ``shard=None`` (replicated): the same model and loop; expected to fail allocating (the rank's
      error is printed), which is the point.

How to run
    python benchmarks/bench_billion.py                  # about 10 minutes on 2 cores, 20 GB of memory
    python benchmarks/bench_billion.py --quick          # smoke run: a small model, the same two runs
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import harness  # benchmarks/harness.py, next to this file
from bench_sharded import mlp  # benchmarks/bench_sharded.py: its MLP, wider here
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autodist

GB = 1e9


def worker(args: argparse.Namespace) -> None:
    limit = int(args.machine_gib * 2**30 / 2)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # this rank's half of the machine, at most
    rank = int(os.environ.get("RANK", "0"))
    shard = None if args.shard == "none" else args.shard
    try:
        start = time.perf_counter()
        model = mlp(args)
        total = sum(p.numel() for p in model.parameters())
        model, _ = autodist.parallelize(model, shard=shard)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        ready = time.perf_counter() - start
        g = torch.Generator().manual_seed(1 + rank)
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
        times, losses = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
        held = autodist.memory(model, optimizer)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        lines = [f"rank {rank}: shard={shard}, {total / 1e9:.2f} B parameters ({16 * total / GB:.1f} GB of "
                 f"replicated Adam training state per rank); built and parallelized in {ready:.0f} s",
                 f"rank {rank}: steps {', '.join(f'{s:.1f}' for s in times)} s; losses "
                 f"{', '.join(f'{v:.4f}' for v in losses)}",
                 f"rank {rank}: held between steps (autodist.memory): " +
                 ", ".join(f"{kind} {value / GB:.2f} GB" for kind, value in held.items()) +
                 f"; total {held.total / GB:.2f} GB; peak resident memory {peak:.2f} GB (limit {limit / GB:.1f} GB)"]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, lines)
        if rank == 0:
            print("\n".join(line for rank_lines in everyone for line in rank_lines), flush=True)
    except (MemoryError, RuntimeError) as e:
        print(f"rank {rank}: shard={shard}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        raise


def launch(parser: harness.Parser, args: argparse.Namespace) -> int:
    env = {"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"}
    print(f"MLP of {args.layers} x {args.width}, 2 ranks, each limited to {args.machine_gib / 2:.0f} GiB of "
          f"address space\n", flush=True)
    sharded = harness.torchrun(parser.script, 2, parser.forwarded(argparse.Namespace(**vars(args) | {
        "shard": "parameters"})), env)
    print(f"\nshard='parameters': exit {sharded}\n", flush=True)
    replicated = harness.torchrun(parser.script, 2, parser.forwarded(argparse.Namespace(**vars(args) | {
        "shard": "none"})), env)
    print(f"\nshard=None (replicated): exit {replicated} "
          f"({'ran out of memory, as expected' if replicated else 'it fit: raise --layers or --width'})", flush=True)
    return 0 if sharded == 0 and (replicated != 0 or args.quick) else 1


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--machine-gib", type=float, default=24.0, help="the memory the two ranks share")
    parser.add_argument("--shard", choices=("parameters", "none"), default="parameters", help=argparse.SUPPRESS)
    args = parser.parse(quick={"layers": 2, "width": 256, "steps": 2})
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
