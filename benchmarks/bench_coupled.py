"""What exactness on coupled batches costs: token weighting read from the loss, and BatchNorm on the global batch.

What it measures
    Two ranks (torchrun; gloo on CPU, NCCL with ``--device cuda`` and a GPU per rank), whole training steps
    (forward, loss, backward, the gradient sync, SGD), in interleaved blocks (timing.py), in two parts:

    tokens     a small language model (embedding, two 4x MLP blocks, head; vocabulary ``--vocab``, ``--seq``
               tokens, global batch ``--batch``), labels with a prompt of varying length at -100, the loss
               ``F.cross_entropy(..., ignore_index=-100)``. autodist weighting each rank by its valid tokens
               (the default: the loss read at ``backward()``, the count summed over the ranks in the gradient
               buckets) against autodist weighting by samples (``samples=``, which reads nothing: inexact here)
               and against DDP (a plain mean over the ranks: inexact too).
    batchnorm  a ResNet-style net (a stem and ``--blocks`` residual blocks of conv-BatchNorm-ReLU on ``--image``
               pixels, ``--channels`` channels), global batch ``--batch``: autodist's BatchNorm on the global
               batch (the default) against its per-rank statistics (``batch_norm="local"``) and DDP (per-rank
               statistics), and with NCCL (a GPU per rank) DDP with torch's ``SyncBatchNorm`` (global
               statistics, every rank weighted alike: exact only for equal shares). torch's SyncBatchNorm runs on
               GPUs only, so elsewhere its row says so.

How to run
    python benchmarks/bench_coupled.py                  # both parts, about two minutes on 2 cores
    python benchmarks/bench_coupled.py --part tokens
    python benchmarks/bench_coupled.py --quick          # smoke run of seconds, timing nothing

How to read it
    Each part prints one line per contender and the ratios of median step times against the first: tokens/
    samples is what reading the loss and counting its tokens cost (about 1.0: the count rides in the buckets,
    and the loss's few operations pass a torch function mode); global/local BatchNorm is what one all-gather
    forward and one all-reduce backward per layer cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import autodist


class LM(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                      for _ in range(2)])
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class ResNetLike(nn.Module):
    def __init__(self, channels: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU())
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_of: Callable) -> timing.Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        timing.settle(batch[0])
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_of(model, *batch).backward()
        optimizer.step()
        timing.settle(batch[0])
        return time.perf_counter() - start

    return step


def _token_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _class_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _tokens(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, timing.Step], str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    prompt = torch.randint(1, args.seq // 2, (args.batch,), generator=g)
    labels = torch.where(torch.arange(args.seq)[None] < prompt[:, None], -100, ids)
    mine = slice(rank * args.batch // size, (rank + 1) * args.batch // size)
    batch = (ids[mine].to(device), labels[mine].to(device))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return LM(args.vocab, args.width).to(device)

    by_tokens, _ = autodist.parallelize(build())
    by_samples, _ = autodist.parallelize(build(), samples=lambda ids: ids.shape[0])
    ddp = DDP(build(), device_ids=[device.index] if device.type == "cuda" else None)
    steps = {"tokens": _step(by_tokens, batch, _token_loss), "samples": _step(by_samples, batch, _token_loss),
             "DDP": _step(ddp, batch, _token_loss)}
    return steps, (f"tokens: LM vocabulary {args.vocab}, width {args.width}, {args.seq} tokens, global batch "
                   f"{args.batch}, {int((labels != -100).sum())} valid labels")


def _batchnorm(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, timing.Step], str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    mine = slice(rank * args.batch // size, (rank + 1) * args.batch // size)
    batch = (x[mine].to(device), y[mine].to(device))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ResNetLike(args.channels, args.blocks).to(device)

    exact, _ = autodist.parallelize(build())
    local, _ = autodist.parallelize(build(), batch_norm="local")
    ids = [device.index] if device.type == "cuda" else None
    steps = {"global": _step(exact, batch, _class_loss), "local": _step(local, batch, _class_loss),
             "DDP": _step(DDP(build(), device_ids=ids), batch, _class_loss)}
    note = ""
    if device.type == "cuda" and dist.get_backend() == "nccl":
        steps["DDP+SyncBN"] = _step(DDP(nn.SyncBatchNorm.convert_sync_batchnorm(build()), device_ids=ids), batch,
                                    _class_loss)
    else:  # gloo on CUDA tensors (ranks sharing a GPU) lacks the all-gather SyncBatchNorm takes
        note = "; DDP+SyncBN: torch's SyncBatchNorm runs on GPUs with NCCL only"
    return steps, (f"batchnorm: ResNet-style, {args.blocks} blocks of {args.channels} channels on {args.image}x"
                   f"{args.image}, global batch {args.batch}{note}")


def run_worker(args: argparse.Namespace) -> None:
    world = autodist.init()
    device = harness.device_of(args)
    parts = {"tokens": _tokens, "batchnorm": _batchnorm}
    for name in (parts if args.part == "all" else [args.part]):
        steps, title = parts[name](args, device)
        times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup, before_block=dist.barrier)
        if world.rank == 0:
            print(f"{world.size} ranks ({world.backend}, {device.type}), {title}", flush=True)
            for contender, ts in times.items():
                print(timing.describe(contender, ts), flush=True)
            first = next(iter(times))
            ratios = ", ".join(f"{first}/{other} {statistics.median(times[first]) / statistics.median(ts):.3f}"
                               for other, ts in times.items() if other != first)
            print(f"  ratios of medians: {ratios}", flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, threads=True, device=True)
    parser.blocks(steps=5, rounds=8, warmup=3)
    parser.add_argument("--part", choices=["tokens", "batchnorm", "all"], default="all")
    parser.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks")
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--image", type=int, default=16)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "batch": 4, "vocab": 50, "width": 8,
                               "seq": 8, "image": 4, "channels": 4, "blocks": 1})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
