"""Low precision against torch's own: bfloat16 data parallelism beside DDP, and the shard levels and the
mixed-precision option beside FSDP2 with ``MixedPrecisionPolicy``.

What it measures
    Two ranks (torchrun, gloo), the benchmarks' MLP 3072-2048-2048-10, Adam, a global batch of ``--batch``.
    Four pairs, each in one set of processes, in interleaved blocks of steps (timing.py):

    * ``bf16``: the model in bfloat16. ``DDP (torch)``: DistributedDataParallel, which all-reduces the bfloat16
      gradients in bfloat16 (each pre-divided by N, then summed: N roundings); ``autodist``: ``parallelize``,
      whose buckets sum them in float32 and round once.
    * ``bf16-parameters``: the model in bfloat16, sharded. ``FSDP2 (torch)``: ``fully_shard`` per Linear with
      ``MixedPrecisionPolicy(reduce_dtype=float32)`` (its parameters stay bfloat16); ``autodist``:
      ``shard="parameters"``.
    * ``mixed``: a float32 model computed in bfloat16. ``FSDP2 (torch)``: ``fully_shard`` per Linear with
      ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; ``autodist``:
      ``mixed_precision="bf16", shard="parameters"`` (both gather each block in bfloat16).
    * ``float32``: the float32 model, DDP against autodist, for scale.

    Beside each step time: the bytes each rank hands its exchange per step (autodist's buckets, DDP's buckets,
    FSDP2's reduce-scatter input, all in the dtype they are summed in). On one machine autodist sums through
    shared memory; ``AUTODIST_SHARED_MEMORY=0`` sends its buckets through gloo as the others do.

How to run
    python benchmarks/bench_precision.py                 # a few minutes on 2 cores
    python benchmarks/bench_precision.py --quick         # smoke run of seconds, timing nothing
    python benchmarks/bench_precision.py --pairs bf16    # one pair
    python benchmarks/bench_precision.py --device cuda   # on the GPU

How to read it
    Per pair: both contenders' step times, the ratio of medians autodist / torch (lower is better), the
    bytes summed per step, and the largest difference of their weights after the run (they train the same
    steps on the same data; bfloat16 rounding, not a sync, is what separates them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from workload import build_model  # benchmarks/workload.py

import autodist
from autodist.dp.grad_sync import is_parallelized, state_of

RANKS = 2
PAIRS = ["bf16", "bf16-parameters", "mixed", "float32"]


def _fsdp2(model: nn.Module, policy: object) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(model[0].weight.device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def torch_side(pair: str, device: torch.device) -> tuple[nn.Module, int]:
    """The peer's model for ``pair``, and the bytes it hands its exchange per step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(seed=0).to(device)
    numel = sum(p.numel() for p in model.parameters())
    if pair == "bf16":
        return DistributedDataParallel(model.to(torch.bfloat16)), 2 * numel
    if pair == "bf16-parameters":
        return _fsdp2(model.to(torch.bfloat16), MixedPrecisionPolicy(reduce_dtype=torch.float32)), 4 * numel
    if pair == "mixed":
        return _fsdp2(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), 4 * numel
    return DistributedDataParallel(model), 4 * numel


def autodist_side(pair: str, device: torch.device) -> tuple[nn.Module, int]:
    """autodist's model for ``pair``, and the bytes of its buckets (what it sums per step)."""
    model = build_model(seed=0).to(device)
    if pair in ("bf16", "bf16-parameters"):
        model = model.to(torch.bfloat16)
    options = {"bf16-parameters": {"shard": "parameters"},
               "mixed": {"shard": "parameters", "mixed_precision": "bf16"}}.get(pair, {})
    model, _ = autodist.parallelize(model, **options)
    summed = sum(b.flat.numel() * b.flat.element_size() for b in state_of(model).buckets)
    return model, summed


def _dense(model: nn.Module) -> torch.Tensor:
    """Every parameter whole, flat, in float32 (a collective for sharded ones: every rank calls it)."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return torch.cat([p.full_tensor().detach().float().reshape(-1) for p in model.parameters()])
    state = autodist.gather_state_dict(model, all_ranks=True) if is_parallelized(model) else \
        dict(model.named_parameters())
    return torch.cat([state[n].detach().float().reshape(-1) for n, _ in model.named_parameters()])


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    timing.settle(x)
    start = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(x).float(), y).backward()
    optimizer.step()
    timing.settle(x)
    return time.perf_counter() - start


def run_worker(args: argparse.Namespace) -> None:
    world = autodist.init()
    device = harness.device_of(args)
    g = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(args.batch // world.size, 3072, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch // world.size,), generator=g).to(device)
    for pair in args.pairs:
        sides = {"torch": torch_side(pair, device), "autodist": autodist_side(pair, device)}
        steps = {}
        for name, (model, _) in sides.items():
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
            low = x.to(torch.bfloat16) if pair in ("bf16", "bf16-parameters") else x
            steps[name] = lambda m=model, o=optimizer, v=low: _step(m, o, v, y)
        times, paired = timing.interleave(steps, args.steps, args.rounds, args.warmup, before_block=dist.barrier)
        gap = (_dense(sides["autodist"][0]) - _dense(sides["torch"][0])).abs().max().item()
        if world.rank == 0:
            ratio = statistics.median(times["autodist"]) / statistics.median(times["torch"])
            print(f"{pair}: 2 ranks ({world.backend}, {device}), global batch {args.batch}", flush=True)
            for name, ts in times.items():
                print(timing.describe(name, ts), f"  summed per step {sides[name][1] / 2**20:.1f} MiB", flush=True)
            print(f"  ratio of medians autodist/torch {ratio:.3f}; paired {statistics.median(paired):.3f}; "
                  f"largest weight difference after the run {gap:.3g}", flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True, device=True)
    parser.blocks(steps=5, rounds=10, warmup=3)
    parser.add_argument("--batch", type=int, default=128, help="global batch, split over the 2 ranks")
    parser.add_argument("--pairs", type=harness.some_of(PAIRS), default=PAIRS,
                        help=f"comma-separated, of {', '.join(PAIRS)}")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
