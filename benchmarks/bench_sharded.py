"""Sharded data parallelism: the bytes each rank holds, peak memory and step time, autodist against torch.

What it measures
    An MLP of ``--layers`` Linear layers of ``--width`` (float32, Adam), ``--batch`` rows per rank, trained
    on ``--ranks`` CPU ranks (gloo) by seven contenders:

    * ``dp``: autodist's data parallelism, every rank holding everything (``shard=None``);
    * ``shard=optimizer``: autodist with each rank keeping 1/N of the optimizer state (ZeRO stage 1);
    * ``shard=gradients``: also 1/N of the averaged gradients, each bucket reduce-scattered (ZeRO stage 2);
    * ``shard=parameters``: also 1/N of the parameters between uses, each Linear layer a block gathered for
      its forward and its backward (fully sharded, ZeRO stage 3);
    * ``DDP (torch)``: torch's ``DistributedDataParallel``, every rank holding everything;
    * ``ZeRO-1 (torch)``: torch's ``DistributedDataParallel`` with ``ZeroRedundancyOptimizer`` (stage 1);
    * ``FSDP2 (torch)``: torch's ``fully_shard`` applied to each Linear layer, then to the model (full).

    ``--frozen K`` freezes the first K layers (fine-tuning a frozen base). ``--shape blocks-head`` makes the
    model the most common plain shape instead: ``--layers`` blocks (``Sequential(Linear, ReLU)``), then a head
    of another type (``Linear(width, 10)``): autodist's blocks are the run, the head is the root, and FSDP2
    shards each block, then the model (torchtitan's way). ``AUTODIST_SHARED_MEMORY=0`` in the environment
    sums the sharded gradients through the backend's reduce-scatter, as across machines, instead of shared
    memory.

    Each contender first runs alone on fresh processes (``--steps`` steps): the *live* bytes a rank holds
    between steps, every tensor storage alive in the process counted once through the garbage collector
    (``benchmarks/live_bytes.py``; pages of shared memory every rank of the host maps count 1/N on each; a
    DTensor its local part; DDP's buckets and everything else included), less the batch; against the
    *ideal*, parameters + gradients + Adam's two moments, each divided by N where the contender shards it
    (+ one block for the fully sharded ones); for autodist, ``autodist.memory``'s breakdown of the same bytes
    by kind; and the peak resident memory during the steps (the process's, VmHWM, reset after the model is
    built). Then all seven run in one set of processes, in interleaved blocks, for the step times (medians,
    and each one's ratio to ``dp``, and ``shard=parameters``'s to FSDP2's); the parameters are checked
    equal after.

How to run
    python benchmarks/bench_sharded.py                  # 2 ranks, about three minutes on 2 cores
    python benchmarks/bench_sharded.py --ranks 4
    python benchmarks/bench_sharded.py --layers 8 --width 2048
    python benchmarks/bench_sharded.py --frozen 7       # the first 7 of 8 layers frozen
    python benchmarks/bench_sharded.py --shape blocks-head   # repeated blocks, then a head of another type
    python benchmarks/bench_sharded.py --quick          # smoke run: tiny model, a few steps
    python benchmarks/bench_sharded.py --device cuda    # on the GPU (the ranks share one where there is one)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
from live_bytes import live_tensor_bytes, reset_peak, resident  # benchmarks/live_bytes.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autodist
from autodist.sharded.parameters import sharding_of as at_rest_of

CONTENDERS = ("dp", "shard=optimizer", "shard=gradients", "shard=parameters", "DDP (torch)", "ZeRO-1 (torch)",
              "FSDP2 (torch)")


def mlp(args: argparse.Namespace) -> nn.Module:
    """``--shape mlp``: Linear and ReLU layers, the head a Linear too (every Linear a block); ``blocks-head``:
    blocks of Linear and ReLU, then the head (the blocks are the run, the head the root)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        pair = [nn.Linear(args.width, args.width), nn.ReLU()]
        layers += [nn.Sequential(*pair)] if getattr(args, "shape", "mlp") == "blocks-head" else pair
    model = nn.Sequential(*layers, nn.Linear(args.width, 10))
    for layer in [m for m in model.modules() if isinstance(m, nn.Linear)][:getattr(args, "frozen", 0)]:
        layer.requires_grad_(False)
    return model


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the model: each Linear layer, or each block before the head."""
    if isinstance(model[0], nn.Sequential):
        return list(model)[:-1]
    return [layer for layer in model if isinstance(layer, nn.Linear)]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def contender(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, optimizer) for ``name``, on ``--device``."""
    device = harness.device_of(args)
    if name == "DDP (torch)":
        from torch.nn.parallel import DistributedDataParallel

        autodist.init()
        model = DistributedDataParallel(mlp(args).to(device))
        return model, torch.optim.Adam(_trainable(model), lr=1e-4)
    if name == "ZeRO-1 (torch)":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        autodist.init()
        model = DistributedDataParallel(mlp(args).to(device))
        return model, ZeroRedundancyOptimizer(_trainable(model), optimizer_class=torch.optim.Adam, lr=1e-4)
    if name == "FSDP2 (torch)":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = autodist.init()
        mesh = init_device_mesh(device.type, (world.size,))
        model = mlp(args).to(device)
        for layer in fsdp_blocks(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(_trainable(model), lr=1e-4)
    model, _ = autodist.parallelize(mlp(args).to(device),
                                    shard=name.removeprefix("shard=") if name.startswith("shard") else None)
    return model, torch.optim.Adam(_trainable(model), lr=1e-4)


def ideal(name: str, args: argparse.Namespace, ranks: int) -> float:
    """Parameters + gradients + Adam's two moments, each divided by N where ``name`` shards it (+ one block,
    gathered, where the parameters are sharded)."""
    model = mlp(args)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in _trainable(model))
    shards = {"dp": (1, 1, 1), "DDP (torch)": (1, 1, 1), "shard=optimizer": (1, 1, ranks), "ZeRO-1 (torch)": (1, 1, ranks),
              "shard=gradients": (1, ranks, ranks)}.get(name, (ranks, ranks, ranks))
    block = args.width * (args.width + 1) * 4 if shards[0] > 1 else 0
    return params / shards[0] + trained / shards[1] + 2 * trained / shards[2] + block


def _dense(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole, flat (a collective for the sharded ones)."""
    if at_rest_of(model) is not None:
        state = model.state_dict()
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    device = harness.device_of(args)
    return (torch.randn(args.batch, args.width, generator=g).to(device),
            torch.randint(0, 10, (args.batch,), generator=g).to(device))


def _step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    timing.settle(x)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    timing.settle(x)
    return time.perf_counter() - start


def alone(args: argparse.Namespace) -> None:
    """One contender on fresh ranks: the live bytes each rank holds between steps (and autodist's breakdown of
    them), and its peak resident memory during the steps."""
    ranks = autodist.init().size
    before = live_tensor_bytes(ranks)
    model, optimizer = contender(args.contender, args)
    x, y = _batch(args)
    reset_peak()
    for _ in range(args.steps):
        _step(model, optimizer, x, y)
    held = {"peak": resident("VmHWM"),
            "live": live_tensor_bytes(ranks) - before - x.numel() * x.element_size() - y.numel() * y.element_size()}
    if args.contender.startswith(("dp", "shard=")):
        held["kinds"] = dict(autodist.memory(model, optimizer))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(everyone, f)


def together(args: argparse.Namespace) -> None:
    """Every contender in these processes, interleaved blocks of steps; the medians, the parameters checked."""
    built = {name: contender(name, args) for name in CONTENDERS}
    x, y = _batch(args)
    steps = {name: (lambda m=m, o=o: _step(m, o, x, y)) for name, (m, o) in built.items()}
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    names = list(CONTENDERS)
    # the same steps on the same data from the same weights: the same parameters
    params = {name: _dense(m) for name, (m, _) in built.items()}
    gap = {n: (params[n] - params["dp"]).abs().max().item() for n in names[1:]}
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"medians": {n: statistics.median(t) for n, t in times.items()}, "gap": gap,
                       "lines": [timing.describe(n, t, 16) for n, t in times.items()]}, f)


def worker(args: argparse.Namespace) -> None:
    (alone if args.contender else together)(args)


def launch(parser: harness.Parser, args: argparse.Namespace) -> int:
    ranks = parser.ranks_of(args)
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = {"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"}
    held = {}
    for name in CONTENDERS:
        run = parser.forwarded(argparse.Namespace(**vars(args) | {"contender": name, "result": result}))
        if harness.torchrun(parser.script, ranks, run, env) != 0:
            return 1
        with open(result) as f:
            held[name] = json.load(f)
    if harness.torchrun(parser.script, ranks, parser.forwarded(argparse.Namespace(**vars(args) | {"result": result})),
                        env) != 0:
        return 1
    with open(result) as f:
        timed = json.load(f)
    os.remove(result)
    total = sum(p.numel() for p in mlp(args).parameters())
    frozen = f", the first {args.frozen} layers frozen" if args.frozen else ""
    shape = "MLP" if args.shape == "mlp" else "blocks (Linear + ReLU) then a Linear head,"
    exchange = "" if os.environ.get("AUTODIST_SHARED_MEMORY", "1") != "0" else \
        ", sharded gradients through the backend's reduce-scatter (AUTODIST_SHARED_MEMORY=0)"
    print(f"\n{ranks} ranks on {args.device}, {shape} {args.layers} x {args.width} ({total / 1e6:.1f} M parameters, "
          f"float32, Adam{frozen}), {args.batch} rows per rank{exchange}\n")
    print("| contender | live / rank (MB) | ideal (MB) | live / ideal | parameters | gradients | optimizer state | "
          "autodist buffers | shared memory | peak RSS in steps (MB) | step (ms) | step vs dp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS:
        worst = max(held[name], key=lambda h: h["live"])
        kinds = worst.get("kinds")
        parts = ([f"{kinds[k] / 1e6:.1f}" for k in ("parameters", "gradients", "optimizer state", "autodist buffers",
                                                   "shared memory")] if kinds else ["-"] * 5)
        median, best = timed["medians"][name], ideal(name, args, ranks)
        print(f"| {name} | {worst['live'] / 1e6:.1f} | {best / 1e6:.1f} | {worst['live'] / best:.3f} | "
              f"{' | '.join(parts)} | {max(h['peak'] for h in held[name]) / 1e6:.0f} | {1e3 * median:.1f} | "
              f"{median / timed['medians']['dp']:.3f} |")
    fsdp = timed["medians"]["FSDP2 (torch)"]
    print(f"\nshard=parameters vs FSDP2 (torch): {timed['medians']['shard=parameters'] / fsdp:.3f} x its step; "
          f"largest block (one Linear layer) {args.width * (args.width + 1) * 4 / 1e6:.1f} MB of parameters")
    print("\nstep times:\n" + "\n".join(timed["lines"]))
    print("largest parameter difference from dp after the same steps: " +
          ", ".join(f"{name} {gap:.1e}" for name, gap in timed["gap"].items()) +
          " (autodist sums the ranks' gradients in rank order, DDP in gloo's ring: Adam amplifies the rounding)")
    return 0


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True, device=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--frozen", type=int, default=0, help="freeze the first FROZEN Linear layers")
    parser.add_argument("--shape", choices=("mlp", "blocks-head"), default="mlp",
                        help="Linear layers (each a block), or blocks of Linear + ReLU then a head of another type")
    parser.add_argument("--steps", type=int, default=5, help="steps per block (and of each run alone)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse(quick={"layers": 2, "width": 64, "steps": 2, "rounds": 2, "warmup": 1})
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
