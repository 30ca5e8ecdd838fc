"""Step time of autodist against DistributedDataParallel, and autodist's cost in a world of one.

What it measures
    1. Two ranks (torchrun, gloo, CPU): the same MLP 3072-2048-2048-10 trained on
       the same global batch (default 128, i.e. 64 per rank) through
       ``torch.nn.parallel.DistributedDataParallel`` and through
       ``autodist.parallelize``. Each rank holds both copies on the one default
       process group and alternates blocks of ``--steps`` steps of each, for
       ``--rounds`` rounds, after a warm-up. A timed step is the whole training
       step: zero_grad, forward, cross-entropy, backward (with its gradient
       all-reduce) and an SGD step.
    2. One process with no launcher: the plain model against the model returned
       by ``autodist.parallelize`` (which should leave it untouched), interleaved
       the same way.

How to run
    python benchmarks/bench_dp.py            # both parts, a couple of minutes on 2 cores
    python benchmarks/bench_dp.py --quick    # smoke run of seconds, timing nothing
    python benchmarks/bench_dp.py --device cuda   # on the GPU (two ranks share one where there is one)

How to read it
    Each line gives min / first quartile / median / third quartile of the step
    time in milliseconds (rank 0's clock; the all-reduce keeps the ranks in
    step). The headline is the ratio of medians, autodist / reference: lower is
    better; the goals are <= 1.00 against DDP and <= 1.02 against the plain
    model in a world of one. "paired" is the median over rounds of the ratio of
    the two blocks' medians in that round; it cancels slow drift of the machine
    (thermal, other load), so when it disagrees with the headline the run was
    noisy. The spread between min and median shows how noisy.

    autodist's summary line says "sync=backward through shared memory" where its ranks sum
    their buckets that way (both ranks are on this machine), which DDP cannot;
    ``AUTODIST_SHARED_MEMORY=0 python benchmarks/...`` times autodist with
    gloo's all-reduce instead, as DDP's buckets travel.
"""
from __future__ import annotations

import argparse
import copy
import sys

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist
from timing import interleave, make_step, report  # benchmarks/timing.py
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from workload import build_model, random_batch  # benchmarks/workload.py

import autodist
from autodist.dp.grad_sync import state_of

RANKS = 2


def layout(buckets: list[list[tuple[str, int]]]) -> str:
    """Buckets, each a list of (parameter name, bytes), as "N buckets [names: MiB] ..."."""
    return f"{len(buckets)} buckets " + " ".join(
        f"[{', '.join(name for name, _ in b)}: {sum(size for _, size in b) / 2**20:.2f} MiB]" for b in buckets)


def bucket_layouts(ddp: DistributedDataParallel, model: nn.Module) -> tuple[str, str]:
    """autodist's and DDP's buckets in send order (DDP's as rebuilt after its first step)."""
    named = list(model.named_parameters())
    name_of = {p: n for n, p in named}
    ours = [[(name_of[p], p.numel() * p.element_size()) for p in b.params] for b in state_of(model).buckets]
    data = ddp._get_ddp_logging_data()  # private, but the only place DDP tells its layout
    per_bucket = str(data.get("rebuilt_per_bucket_param_indices", "")).split(",")  # e.g. "5 4 3 2, 1 0"
    theirs = [[(named[int(i)][0], named[int(i)][1].numel() * named[int(i)][1].element_size()) for i in idx.split()]
              for idx in per_bucket if idx.strip()]
    return layout(ours), layout(theirs)


def run_worker(args: argparse.Namespace) -> None:
    """One of the two torchrun ranks: DDP and autodist side by side on the same process group."""
    world = autodist.init()  # starts the gloo group that DDP then shares
    assert world.size == RANKS, f"expected {RANKS} ranks, got {world.size}"
    device = harness.device_of(args)
    reference = build_model(seed=0).to(device)
    contender = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference)
    contender, _ = autodist.parallelize(contender)
    # One fixed batch per rank, reused: data loading stays out of the timed step.
    x, y = (t.to(device) for t in random_batch(args.batch // world.size, seed=1 + world.rank))
    # The barrier lines the ranks up, so one rank's lag does not land in the next block's first step.
    times, paired = interleave({"ddp": make_step(ddp, x, y), "autodist": make_step(contender, x, y)},
                               args.steps, args.rounds, args.warmup, before_block=dist.barrier)
    # Both took the same SGD steps on the same global batch (even shards: DDP's plain mean is exact here),
    # so a fast but wrong sync would show up as different weights.
    for (name, theirs_p), ours_p in zip(reference.named_parameters(), contender.parameters()):
        torch.testing.assert_close(ours_p, theirs_p, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"autodist and DDP disagree on {n} after the run: {m}")
    if world.rank == 0:
        ours, theirs = bucket_layouts(ddp, contender)
        report(f"2 ranks ({world.backend}, {device}, {args.threads} thread(s) each), global batch {args.batch}:",
               times, paired, 1.00)
        print(f"  autodist: {ours}\n  ddp:      {theirs}", flush=True)
        steps = args.warmup + args.rounds * args.steps
        print(f"  after {steps} steps each, autodist's and DDP's weights agree (rtol 1e-4)", flush=True)


def run_solo(args: argparse.Namespace) -> None:
    """World of one: the plain model against what ``parallelize`` returns for a copy of it."""
    device = harness.device_of(args)
    plain = build_model(seed=0).to(device)
    returned, _ = autodist.parallelize(copy.deepcopy(plain))
    assert autodist.init().size == 1, "the world-of-one part must run without a launcher"
    x, y = (t.to(device) for t in random_batch(args.batch, seed=1))
    times, paired = interleave({"plain": make_step(plain, x, y), "autodist": make_step(returned, x, y)},
                               args.steps, args.rounds, args.warmup)
    report(f"world of one ({device}, {args.threads} thread(s)), batch {args.batch}:", times, paired, 1.02)


def main() -> int:
    """Both parts one after the other, each in processes of its own, so they never share the cores."""
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True, solo=True, device=True)
    parser.blocks(steps=10, rounds=20, warmup=5)
    parser.add_argument("--batch", type=int, default=128, help="global batch, split over the 2 ranks")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1})
    if args.batch % RANKS:
        parser.error(f"--batch must be divisible by {RANKS}")
    return harness.run(parser, args, run_worker, solo_part=run_solo)


if __name__ == "__main__":
    sys.exit(main())
