"""checkpoint=True against torch's own activation checkpointing: peak memory and step time, side by side.

What it measures
    nanoGPT-style decoders (``benchmarks/gpt_block.py``: ``--layers`` blocks of ``--width``, 4 heads,
    ``--seq`` tokens, a global batch of ``--batch``, float32, Adam) on ``--ranks`` CPU ranks (gloo), four
    contenders:

    * ``autodist``: ``parallelize(model)``, nothing recomputed;
    * ``autodist checkpoint=True``: ``parallelize(model, checkpoint=True)``, each block recomputed in backward;
    * ``DDP (torch)``: torch's ``DistributedDataParallel``, nothing recomputed;
    * ``DDP + checkpoint_wrapper (torch)``: DDP around the same model with torch's
      ``apply_activation_checkpointing`` wrapping each block (non-reentrant ``torch.utils.checkpoint``).

    Memory, each contender alone in the process (built, two steps, then freed before the next): every tensor
    byte the rank holds between steps, found through the garbage collector (``benchmarks/live_bytes.py``:
    parameters, gradients, Adam's state, autodist's buffers and its share of the shared memory; DDP's
    buckets, which its C++ reducer holds, from DDP's own logging data), plus the most a step makes above
    that (every storage an op makes, counted until freed: ``autodist.planner.live.LiveBytes``): the rank's
    peak, counted alike for all four. Time: the four in one set of processes, interleaved blocks of steps,
    medians and each one's ratio to its peer (autodist's to DDP's, with and without recomputation). The
    parameters are checked equal after.

How to run
    python benchmarks/bench_checkpoint.py                 # 2 ranks, about a minute on 2 cores
    python benchmarks/bench_checkpoint.py --layers 8 --seq 256
    python benchmarks/bench_checkpoint.py --quick
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import gc

import harness  # benchmarks/harness.py, next to this file
from live_bytes import live_tensor_bytes  # benchmarks/live_bytes.py
import timing  # benchmarks/timing.py
from gpt_block import GPT, Block  # benchmarks/gpt_block.py
import torch
import torch.nn.functional as F
from torch import nn

import autodist
from autodist.planner.live import LiveBytes

CONTENDERS = ("autodist", "autodist checkpoint=True", "DDP (torch)", "DDP + checkpoint_wrapper (torch)")


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=256, width=args.width, heads=4, layers=args.layers, seq=args.seq)


def contender(name: str, args: argparse.Namespace) -> nn.Module:
    if name.startswith("autodist"):
        model, _ = autodist.parallelize(build(args), checkpoint=name.endswith("True"))
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from torch.nn.parallel import DistributedDataParallel

    autodist.init()
    model = build(args)
    if "wrapper" in name:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, Block))
    return DistributedDataParallel(model)


def _ddp_buckets(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets, which its C++ reducer holds (no Python object the collector finds)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(b) for b in sizes.split(",") if b.strip())


def worker(args: argparse.Namespace) -> None:
    rank, size = autodist.rank(), autodist.world_size()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[rank::size, :-1], tokens[rank::size, 1:].flatten()
    models: dict[str, nn.Module] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}

    def step(name: str) -> float:
        start = time.perf_counter()
        optimizers[name].zero_grad()
        F.cross_entropy(models[name](x), y).backward()
        optimizers[name].step()
        return time.perf_counter() - start

    peaks, held = {}, {}
    for name in CONTENDERS:  # alone: what the rank holds is this contender's
        models[name] = contender(name, args)
        optimizers[name] = torch.optim.Adam(models[name].parameters(), lr=1e-4)
        step(name)  # the optimizer's state
        optimizers[name].zero_grad()
        at_rest = live_tensor_bytes(sharers=size) - sum(t.numel() * t.element_size() for t in (x, y)) + \
            _ddp_buckets(models[name])
        with LiveBytes() as live:
            step(name)
        t = torch.tensor([at_rest + live.peak, at_rest])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peaks[name], held[name] = float(t[0]), float(t[1])
        del models[name], optimizers[name]
        gc.collect()
    models = {name: contender(name, args) for name in CONTENDERS}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, m in models.items()}
    times, _ = timing.interleave({n: functools.partial(step, n) for n in CONTENDERS}, args.steps, args.rounds,
                                 args.warmup)
    medians = {n: statistics.median(ts) for n, ts in times.items()}
    dense = {n: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for n, m in models.items()}
    if rank == 0:
        print(f"{args.layers} blocks of width {args.width}, {args.seq} tokens, global batch {args.batch}, "
              f"{size} ranks; held between steps and the step's peak (MB per rank), step time (median ms):")
        for name in CONTENDERS:
            print(f"  {name:<34} held {held[name] / 1e6:8.1f} MB   peak {peaks[name] / 1e6:8.1f} MB   "
                  f"step {1e3 * medians[name]:8.2f} ms")
        for ours, theirs in (("autodist", "DDP (torch)"),
                             ("autodist checkpoint=True", "DDP + checkpoint_wrapper (torch)")):
            print(f"  {ours} / {theirs}: peak x{peaks[ours] / peaks[theirs]:.2f}, "
                  f"step x{medians[ours] / medians[theirs]:.2f}")
        saved = 1 - (peaks["autodist checkpoint=True"] - held["autodist checkpoint=True"]) / (
            peaks["autodist"] - held["autodist"])
        cost = medians["autodist checkpoint=True"] / medians["autodist"] - 1
        print(f"  checkpoint=True makes {100 * saved:.0f}% fewer bytes above what is held, for {100 * cost:+.0f}% "
              f"step time")
        for name in CONTENDERS[1:]:  # Adam magnifies the summation order's rounding: loose, but not blind
            torch.testing.assert_close(dense[name], dense["autodist"], rtol=1e-3, atol=1e-4)
        print("  parameters after the steps: equal (rtol 1e-3)", flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.blocks(steps=3, rounds=6, warmup=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "layers": 2, "width": 32, "seq": 16,
                               "batch": 4})
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
