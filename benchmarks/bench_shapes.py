"""Step time of autodist against DistributedDataParallel on four more shapes: no_sync, 2 transformers, a ResNet.

What it measures
    Two ranks (torchrun, gloo, CPU, 1 thread each by default), as in
    ``bench_dp.py``: each rank holds a DDP copy and an ``autodist.parallelize``
    copy of the same model (deep copies of one seeded build) on the one default
    process group, feeds both the same fixed per-rank batch (built before
    timing: no data loading in the step) and alternates blocks of steps of each,
    the order flipping every round, after a warm-up. Workloads (``--only``):
      nosync  gradient accumulation: the MLP 3072-2048-2048-10 of bench_dp, 4
              micro-batches of 128 (64 per rank) per optimizer step; the first 3
              backwards inside ``ddp.no_sync()`` / ``autodist.no_sync(model)``,
              the 4th outside syncs. 6 parameter tensors.
      tfm2    a pre-norm transformer LM (benchmarks/shapes.py): vocabulary 1000,
              64 tokens, d_model 128, 4 heads, feed-forward 512, dropout 0, token
              and position embeddings, 2 nn.TransformerEncoderLayer(batch_first,
              norm_first) with a causal mask, final LayerNorm, untied bias-free
              head: 29 parameter tensors. Batch 32 sequences (16 per rank),
              cross-entropy over every token.
      tfm12   the same with 12 layers: 149 parameter tensors.
      resnet  ResNet-20 (3 stages of 3 basic blocks, 16/32/64 channels,
              BatchNorm, 1x1 projection shortcuts), 3x32x32 inputs, 10 classes,
              batch 64 (32 per rank): 65 parameter tensors. Both sides keep
              their defaults for BatchNorm's running statistics (DDP broadcasts
              rank 0's buffers at every forward, autodist averages them at
              every sync).
    A timed step is the whole optimizer step: zero_grad, forward, cross-entropy
    and backward (with its gradient all-reduce; for nosync 4 of them), SGD step
    (lr 1e-3). After each workload the two copies' parameters are checked to
    still agree (rtol 1e-4, atol 1e-6), so a fast but wrong sync cannot pass.

How to run
    python benchmarks/bench_shapes.py                       # all four, about 6 minutes on 2 idle cores
    python benchmarks/bench_shapes.py --quick               # smoke run of seconds, timing nothing
    python benchmarks/bench_shapes.py --only nosync,tfm2    # some of them
    python benchmarks/bench_shapes.py --steps 5 --rounds 20 --warmup 2   # same block size for all

How to read it
    Per workload, each line gives min / first quartile / median / third
    quartile of the step time in milliseconds (rank 0's clock), then the ratio
    of medians autodist / DDP (lower is better, goal <= 1.00) and the paired
    per-round ratio, which cancels slow drift of the machine: when it disagrees
    with the headline the run was noisy. A markdown table of the medians and
    ratios closes the run.

    autodist's summary line says "sync=backward through shared memory" where its ranks sum
    their buckets that way (both ranks are on this machine), which DDP cannot;
    ``AUTODIST_SHARED_MEMORY=0 python benchmarks/...`` times autodist with
    gloo's all-reduce instead, as DDP's buckets travel.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import harness  # benchmarks/harness.py, next to this file
import shapes  # benchmarks/shapes.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import Step, interleave, make_step, report  # benchmarks/timing.py
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from workload import build_model, random_batch  # benchmarks/workload.py

import autodist

RANKS = 2
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]  # the same model on every call (seeded)
    batch: Callable[[int, int], Batch]  # (rows, seed) -> inputs, targets
    global_batch: int  # rows of one micro-batch over all ranks
    steps: int  # default steps per block: blocks of 1 to 2 s on 2 cores
    micro_batches: int = 1  # > 1: accumulate under no_sync, sync on the last
    loader: bool = True  # autodist gets its batches from the DataLoader it sharded; False: counts inferred


WORKLOADS: dict[str, Workload] = {
    "nosync": Workload(lambda: build_model(seed=0), random_batch, 128, 5, micro_batches=4),
    "nosync_inferred": Workload(lambda: build_model(seed=0), random_batch, 128, 5, micro_batches=4, loader=False),
    "tfm2": Workload(lambda: shapes.build_lm(2, seed=0), shapes.token_batch, 32, 16),
    "tfm12": Workload(lambda: shapes.build_lm(12, seed=0), shapes.token_batch, 32, 6),
    "resnet": Workload(lambda: shapes.build_resnet(seed=0), shapes.image_batch, 64, 12),
}


def accumulate_step(model: nn.Module, micro: list[Batch], no_sync: Callable[[], AbstractContextManager]) -> Step:
    """One optimizer step over several micro-batches, all but the last backward inside ``no_sync()``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        for x, y in micro[:-1]:
            with no_sync():
                F.cross_entropy(model(x), y).backward()
        x, y = micro[-1]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def global_batches(work: Workload) -> DataLoader:
    """The single-process loader of one optimizer step: ``micro_batches`` global batches, the same on every rank."""
    parts = [work.batch(work.global_batch, 1 + k) for k in range(work.micro_batches)]
    data = TensorDataset(*(torch.cat(tensors) for tensors in zip(*parts)))
    return DataLoader(data, batch_size=work.global_batch, shuffle=False)


def contenders(work: Workload, rank: int) -> tuple[nn.Module, nn.Module, dict[str, Step]]:
    """The DDP-wrapped module, autodist's copy of it, and their steps on this rank's fixed batches.

    The batches are this rank's slices of the global ones, as the DataLoader that ``parallelize`` returns
    yields them (fetched once, before timing); autodist knows their shares from that loader, as in a
    user's loop, unless the workload asks for inferred counts (``parallelize`` without data).
    """
    reference = work.build()
    contender = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference)
    # BatchNorm with each rank's statistics, as DDP's: the same computation timed (the global batch's, autodist's
    # default, against DDP and SyncBatchNorm: bench_coupled.py)
    contender, shards = autodist.parallelize(contender, global_batches(work) if work.loader else None,
                                             batch_norm="local")
    if shards is None:
        rows = work.global_batch // RANKS
        shards = [tuple(t[rank * rows:(rank + 1) * rows] for t in batch) for batch in global_batches(work)]
    micro = list(shards)
    if work.micro_batches == 1:
        steps = {"ddp": make_step(ddp, *micro[0]), "autodist": make_step(contender, *micro[0])}
    else:
        steps = {"ddp": accumulate_step(ddp, micro, ddp.no_sync),
                 "autodist": accumulate_step(contender, micro, lambda: autodist.no_sync(contender))}
    return reference, contender, steps


def assert_same_parameters(reference: nn.Module, contender: nn.Module) -> None:
    # Parameters only: BatchNorm's running statistics are buffers, which DDP broadcasts from rank 0 and
    # autodist averages over the ranks; neither feeds the parameters in train mode, so these must agree.
    for (name, theirs), ours in zip(reference.named_parameters(), contender.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"autodist and DDP disagree on {n} after the run: {m}")


def run_workload(name: str, args: argparse.Namespace, rank: int) -> tuple[float, float] | None:
    """Time one workload; on rank 0 print its summary and return (DDP, autodist) median seconds."""
    work = WORKLOADS[name]
    reference, contender, steps = contenders(work, rank)
    block = args.steps or work.steps
    times, paired = interleave(steps, block, args.rounds, args.warmup, before_block=dist.barrier)
    assert_same_parameters(reference, contender)
    if rank != 0:
        return None
    params = list(contender.parameters())
    micro = f", {work.micro_batches} micro-batches per step" if work.micro_batches > 1 else ""
    report(f"{name}: {len(params)} parameter tensors, {sum(p.numel() for p in params):,} parameters, "
           f"global batch {work.global_batch}{micro}:", times, paired, 1.00)
    print(f"  after {args.warmup + args.rounds * block} steps each, the parameters agree (rtol 1e-4)\n", flush=True)
    return statistics.median(times["ddp"]), statistics.median(times["autodist"])


def table(medians: dict[str, tuple[float, float]]) -> str:
    rows = [f"| {name} | {1e3 * ddp:.1f} | {1e3 * ours:.1f} | {ours / ddp:.3f} |"
            for name, (ddp, ours) in medians.items()]
    return "\n".join(["| workload | DDP median ms | autodist median ms | autodist / DDP |", "|---|---|---|---|", *rows])


def run_worker(args: argparse.Namespace) -> None:
    """One of the two torchrun ranks: every chosen workload in turn, on the same process group."""
    world = autodist.init()  # starts the gloo group that DDP then shares
    assert world.size == RANKS, f"expected {RANKS} ranks, got {world.size}"
    if world.rank == 0:
        print(f"2 ranks (gloo, {args.threads} thread(s) each), {args.rounds} rounds, warm-up {args.warmup}\n",
              flush=True)
    medians: dict[str, tuple[float, float]] = {}
    for name in args.only:
        result = run_workload(name, args, world.rank)
        if result is not None:
            medians[name] = result
    if world.rank == 0:
        print(table(medians), flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True)
    parser.add_argument("--only", type=harness.some_of(list(WORKLOADS)), default=list(WORKLOADS),
                        help=f"comma-separated workloads, of {','.join(WORKLOADS)} (default: all)")
    parser.blocks(steps=0, rounds=30, warmup=3, min_steps=0,
                  steps_help="steps per block for every workload (default 0: per workload, "
                             + ", ".join(f"{n} {w.steps}" for n, w in WORKLOADS.items()) + ")")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
