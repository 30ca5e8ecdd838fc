"""Sharded data parallelism: per-rank training-state bytes, peak memory and step time, autodist against torch.

What it measures
    An MLP of ``--layers`` Linear layers of ``--width`` (float32, Adam), ``--batch`` rows per rank, trained
    on ``--ranks`` CPU ranks (gloo) by three contenders:

    * ``dp``: autodist's data parallelism, every rank holding everything (``shard=None``);
    * ``shard=optimizer``: autodist with each rank keeping 1/N of the optimizer state (ZeRO stage 1);
    * ``shard=gradients``: also 1/N of the averaged gradients, each bucket reduce-scattered (ZeRO stage 2);
    * ``shard=parameters``: also 1/N of the parameters between uses, each Linear layer a block gathered for
      its forward and its backward (fully sharded, ZeRO stage 3);
    * ``ZeRO-1 (torch)``: torch's ``DistributedDataParallel`` with ``ZeroRedundancyOptimizer`` (stage 1);
    * ``FSDP2 (torch)``: torch's ``fully_shard`` applied to each Linear layer, then to the model (full).

    Each contender first runs alone on fresh processes (``--steps`` steps): the bytes of parameters,
    gradients and optimizer state each rank holds between steps (parameters: this rank's shards where they
    are sharded at rest, the local shards of FSDP2's DTensors; gradients: every distinct storage behind
    ``.grad`` and autodist's gradient buckets, counting a rank's own slots of shared memory but not the
    shared sum of ``shard=None`` and ``shard=optimizer`` on one machine, one bucket-set for all ranks;
    DDP's own buckets are not counted; FSDP2's: its local shards), and the rank's peak resident memory
    (``ru_maxrss``). Then all three run in one set of processes, in interleaved blocks, for the step times
    (medians, and each one's ratio to ``dp``, and ``shard=parameters``'s to FSDP2's); the parameters are
    checked equal after.

How to run
    python benchmarks/bench_sharded.py                  # 2 ranks, about a minute on 2 cores
    python benchmarks/bench_sharded.py --ranks 4
    python benchmarks/bench_sharded.py --quick          # smoke run: tiny model, a few steps
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autodist
from autodist.dp.grad_sync import state_of
from autodist.sharded.grads import ShardedGrad
from autodist.sharded.optimizer import sharding_of
from autodist.sharded.parameters import sharding_of as at_rest_of
from autodist.sharded.scatter import ScatteredBucket

CONTENDERS = ("dp", "shard=optimizer", "shard=gradients", "shard=parameters", "ZeRO-1 (torch)", "FSDP2 (torch)")


def mlp(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 10))


def contender(name: str, args: argparse.Namespace):
    """(model, optimizer, bytes of optimizer state this rank holds) for ``name``."""
    if name == "ZeRO-1 (torch)":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        autodist.init()
        model = DistributedDataParallel(mlp(args))
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        return model, optimizer, lambda: _state_bytes(optimizer.optim.state)
    if name == "FSDP2 (torch)":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = autodist.init()
        mesh = init_device_mesh("cpu", (world.size,))
        model = mlp(args)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        return model, optimizer, lambda: _state_bytes(optimizer.state)
    model, _ = autodist.parallelize(mlp(args), shard=name.removeprefix("shard=") if name.startswith("shard") else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    sharding = sharding_of(model)
    return model, optimizer, (lambda: sharding.held_bytes()) if sharding else lambda: _state_bytes(optimizer.state)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and state); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(state) -> int:
    return sum(_local(v).numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v))


def _parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps."""
    at_rest = at_rest_of(model)
    if at_rest is not None:
        return at_rest.held_bytes()
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def _dense(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole, flat (a collective for the sharded ones)."""
    if at_rest_of(model) is not None:
        state = model.state_dict()
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _gradient_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage holding gradients on this rank (see the module docstring)."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        if p.grad is not None and not isinstance(p.grad, ShardedGrad):
            add(_local(p.grad))
    sync = state_of(model)
    for bucket in sync.buckets if sync is not None else []:
        add(bucket.flat)  # shard=gradients: its ring buffer
        if isinstance(bucket, ScatteredBucket):
            add(bucket.part)
            add(bucket.meta)
    return sum(storages.values())


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def _step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start


def alone(args: argparse.Namespace) -> None:
    """One contender on fresh ranks: the bytes each rank holds, and its peak resident memory."""
    model, optimizer, state_bytes = contender(args.contender, args)
    x, y = _batch(args)
    for _ in range(args.steps):
        _step(model, optimizer, x, y)
    held = {"parameters": _parameter_bytes(model),
            "gradients": _gradient_bytes(model),
            "optimizer": state_bytes(), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(everyone, f)


def together(args: argparse.Namespace) -> None:
    """Every contender in these processes, interleaved blocks of steps; the medians, the parameters checked."""
    built = {name: contender(name, args) for name in CONTENDERS}
    x, y = _batch(args)
    steps = {name: (lambda m=m, o=o: _step(m, o, x, y)) for name, (m, o, _) in built.items()}
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    names = list(CONTENDERS)
    # the same steps on the same data from the same weights: the same parameters
    params = {name: _dense(m) for name, (m, _, _) in built.items()}
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
    print(f"\n{ranks} ranks, MLP of {args.layers} x {args.width} ({total / 1e6:.1f} M parameters, float32, Adam), "
          f"{args.batch} rows per rank\n")
    print("| contender | parameters / rank (MB) | gradients / rank (MB) | optimizer state / rank (MB) | "
          "state vs replicated | peak RSS, rank 0 (MB) | step (ms) | step vs dp |")
    print("|---|---|---|---|---|---|---|---|")
    full = max(h["optimizer"] for h in held["dp"])
    for name in CONTENDERS:
        worst = {k: max(h[k] for h in held[name]) for k in ("parameters", "gradients", "optimizer")}
        median = timed["medians"][name]
        print(f"| {name} | {worst['parameters'] / 1e6:.1f} | {worst['gradients'] / 1e6:.1f} | "
              f"{worst['optimizer'] / 1e6:.1f} | {worst['optimizer'] / full:.3f} (1/N = {1 / ranks:.3f}) | "
              f"{held[name][0]['peak_rss'] / 1e6:.0f} | {1e3 * median:.1f} | "
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
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=5, help="steps per block (and of each run alone)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse(quick={"layers": 2, "width": 64, "steps": 2, "rounds": 2, "warmup": 1})
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
