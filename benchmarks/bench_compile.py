"""torch.compile on a parallelized model: compiled autodist against torch's compiled layouts, step times in one run.

What it measures
    Four contenders per ``--layout``, built in the same processes on 2 CPU ranks (gloo) and timed in interleaved
    blocks of steps. Each contender's graph breaks (``torch._dynamo`` counters) are counted during its first step,
    which compiles it cold (dynamo reset before it, inductor's caches off: no graph or kernel of another contender
    or an earlier run); the GPT layouts also count the graphs dynamo compiled there; a count that differs between
    the ranks reads "rank 0 / rank 1", the first step is the slower rank's. The medians of the step times (rank 0's)
    and their ratios to torch's compiled contender are printed.

    * ``dp`` (the default): an MLP of ``--layers`` Linear layers of ``--width`` (float32, SGD), ``--batch`` rows
      per rank. ``autodist``: ``parallelize`` (data parallel), uncompiled; ``autodist compiled``: the same, then
      ``torch.compile(model, backend=--backend)``; ``DDP``: ``DistributedDataParallel``, uncompiled;
      ``DDP compiled``: ``torch.compile(ddp_model)``, whose graph dynamo splits at DDP's bucket boundaries.
    * ``parameters``: a GPT of the user's own blocks (``gpt_block.py``: ``--layers`` blocks of ``--width``,
      ``--heads`` heads, ``--seq`` tokens, a vocabulary of ``--vocab``; float32, AdamW), ``--batch`` rows per
      rank. ``autodist``: ``parallelize(model, loader, shard="parameters")``; ``autodist compiled``: the same,
      then ``torch.compile(model)``; ``FSDP2``: ``fully_shard`` per block, then on the model; ``FSDP2 compiled``:
      as torchtitan does it, each block replaced by ``torch.compile(block)`` before ``fully_shard``.
    * ``pp``: the same GPT (SGD) in 2 pipeline stages, a global batch of 2 x ``--batch`` rows in
      ``--microbatches`` micro-batches, GPipe. ``autodist``: ``parallelize(model, loader, pp=2,
      microbatches=M)``; ``autodist compiled``: then ``torch.compile(model)``; ``torch GPipe``: a
      ``torch.distributed.pipelining`` stage built by hand (``bench_pipeline.py``'s, at autodist's cut);
      ``torch GPipe compiled``: the same, each of the stage's blocks compiled before the stage is built.

    Under dp and parameters each rank takes half of every global batch (autodist from the DataLoader
    ``parallelize`` returns, torch from a DistributedSampler); under pp both stages take all of it. A contender
    that fails to build or to take its first step is left out of the table, with the reason printed.

How to run
    python benchmarks/bench_compile.py                      # dp; inductor; a few minutes on 2 cores, mostly compiling
    python benchmarks/bench_compile.py --layout parameters  # against FSDP2: GPT 4 x 256, 8 x 64 tokens a rank; 1 min
    python benchmarks/bench_compile.py --layout pp          # against torch's GPipe, 4 micro-batches; about 1 minute
    python benchmarks/bench_compile.py --quick --layout pp  # smoke run (any layout): aot_eager, tiny model, few steps
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import bench_pipeline as pipeline  # benchmarks/bench_pipeline.py: the GPT, its tokens, torch's stage
import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_sharded import mlp  # benchmarks/bench_sharded.py: the same MLP
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autodist
from autodist.pp.pipeline import pipeline_of

LAYOUTS = {"dp": ("autodist", "autodist compiled", "DDP", "DDP compiled"),
           "parameters": ("autodist", "autodist compiled", "FSDP2", "FSDP2 compiled"),
           "pp": ("autodist", "autodist compiled", "torch GPipe", "torch GPipe compiled")}
GPT_SIZES = {"width": 256, "batch": 8}
DEFAULTS = {"dp": {"width": 512, "batch": 32}, "parameters": GPT_SIZES, "pp": GPT_SIZES}  # where not given
Step = Callable[[], float]  # one training step on the contender's next batch; its wall time in seconds


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
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), endless(loader)


def endless(loader: DataLoader) -> Iterator:
    """``loader``'s batches over and over (autodist's stay current while the step runs: their share counts)."""
    return itertools.chain.from_iterable(itertools.repeat(loader))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
          loss: Callable[..., torch.Tensor] = F.cross_entropy) -> float:
    x, y = next(batches)
    start = time.perf_counter()
    optimizer.zero_grad()
    loss(model(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start


def data_parallel(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], Step]]]:
    """``--layout dp``: each contender's name and how to build its step."""
    g = torch.Generator().manual_seed(1)
    n = 2 * args.batch * 8
    dataset = TensorDataset(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    for name in LAYOUTS["dp"]:
        def build(name: str = name) -> Step:
            model, optimizer, batches = contender(name, args, dataset)
            return lambda: _step(model, optimizer, batches)
        yield name, build


def gpt_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_pipeline's options for the same GPT: its batch is the global one (both ranks' rows), 4 distinct."""
    return argparse.Namespace(**vars(args) | {"batch": 2 * args.batch, "distinct": 4})


def compile_blocks(gpt: nn.Module, backend: str) -> nn.Module:
    """torchtitan's way: each block replaced in its ModuleList by ``torch.compile(block)``."""
    for i, block in enumerate(gpt.blocks):
        gpt.blocks[i] = torch.compile(block, backend=backend)
    return gpt


def sharded(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], Step]]]:
    """``--layout parameters``: autodist's ``shard="parameters"`` and FSDP2, each uncompiled and compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = pipeline.token_data(gpt_args(args))

    def build(name: str) -> Step:
        gpt, compiled = pipeline.build(args), name.endswith("compiled")
        if name.startswith("autodist"):
            model, loader = autodist.parallelize(gpt, DataLoader(data, batch_size=2 * args.batch), shard="parameters")
            model = torch.compile(model, backend=args.backend) if compiled else model
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in (compile_blocks(gpt, args.backend) if compiled else gpt).blocks:
                fully_shard(block, mesh=mesh)
            model = fully_shard(gpt, mesh=mesh)
            loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False))
        optimizer, batches = torch.optim.AdamW(model.parameters(), lr=1e-4), endless(loader)
        return lambda: _step(model, optimizer, batches, pipeline.lm_loss)

    for name in LAYOUTS["parameters"]:
        yield name, lambda name=name: build(name)


def piped(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], Step]]]:
    """``--layout pp``: autodist's ``pp=2`` and torch's GPipe stage at autodist's cut, uncompiled and compiled."""
    every, bounds = gpt_args(args), [0, args.layers // 2, args.layers]  # autodist's cut, once it is made
    data = pipeline.token_data(every)

    def build(name: str) -> Step:
        gpt, compiled = pipeline.build(args), name.endswith("compiled")
        if name.startswith("autodist"):
            model, loader = autodist.parallelize(gpt, DataLoader(data, batch_size=every.batch), pp=2,
                                                 microbatches=args.microbatches)
            bounds[:] = pipeline_of(model).cut.bounds
            model = torch.compile(model, backend=args.backend) if compiled else model
            return pipeline.plain_loop(model, list(loader)).train_step
        gpt = compile_blocks(gpt, args.backend) if compiled else gpt
        batches = list(DataLoader(data, batch_size=every.batch))
        return pipeline.torch_pipeline("torch GPipe", gpt, bounds, dist.get_rank(), batches, every).train_step

    for name in LAYOUTS["pp"]:
        yield name, lambda name=name: build(name)


def first_step(make: Callable[[], Step]) -> tuple[Step | None, tuple[int, int, float] | str]:
    """Build a contender and take its first step (a compiled one compiles here): its step and (graph breaks,
    graphs compiled, seconds), or None and why it failed (one line)."""
    from torch._dynamo.utils import counters

    try:
        step = make()
        torch._dynamo.reset()  # its own graphs: none taken from another contender's of the same blocks' code
        counters.clear()
        start = time.perf_counter()
        step()
        return step, (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                      time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - reported, and the contender left out
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:300]


def setting(args: argparse.Namespace) -> str:
    """The run's model and batch, in words."""
    if args.layout == "dp":
        return f"MLP of {args.layers} x {args.width}, {args.batch} rows per rank"
    gpt = (f"GPT of {args.layers} blocks x width {args.width}, {args.heads} heads, vocabulary {args.vocab}, "
           f"{args.seq} tokens per row")
    if args.layout == "parameters":
        return f"{gpt}, {args.batch} rows per rank, shard=parameters / FSDP2, AdamW"
    return f"{gpt}, global batch {2 * args.batch} rows in {args.microbatches} micro-batches, pp=2 GPipe, SGD"


def worker(args: argparse.Namespace) -> None:
    from torch._inductor import config

    autodist.init()
    config.force_disable_caches = True  # each compiles cold: no kernels of another's, or a past run's
    layout = {"dp": data_parallel, "parameters": sharded, "pp": piped}[args.layout]
    steps, first, failed = {}, {}, {}
    for name, make in layout(args):
        step, result = first_step(make)
        if step is None:
            failed[name] = result
        else:
            steps[name], first[name] = step, result
    everyone = pipeline.gathered((first, failed))  # a contender failed on any rank is left out on all
    failed = {name: why for _, theirs in everyone for name, why in theirs.items()}
    for name in failed:
        steps.pop(name, None)
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    if dist.get_rank() == 0:
        print_table(args, {name: statistics.median(t) for name, t in times.items()},
                    {name: [theirs[name] for theirs, _ in everyone] for name in times}, failed)
        width = max(18, *map(len, times))
        print("\nstep times:\n" + "\n".join(timing.describe(name, t, width) for name, t in times.items()))


def per_rank(values: list) -> str:
    """A count as a table cell: one number where the ranks agree, else each rank's (rank 0 / rank 1)."""
    return str(values[0]) if len(set(values)) == 1 else " / ".join(map(str, values))


def print_table(args: argparse.Namespace, medians: dict[str, float], first: dict[str, list], failed: dict[str, str]
                ) -> None:
    """The markdown table: each contender's graph breaks (and graphs), its first step (the slower rank's), its
    median step (rank 0's) and that over torch's compiled contender's; then the contenders left out, and why."""
    reference = LAYOUTS[args.layout][-1]
    graphs = args.layout != "dp"  # dp's table is as it was before the GPT layouts
    print(f"\n2 ranks, {setting(args)}, backend {args.backend}\n")
    print(f"| contender | graph breaks |{' graphs |' if graphs else ''} first step, compiling (s) | step (ms) "
          f"| vs {reference} |")
    print("|---|---|---|---|---|" + ("---|" if graphs else ""))
    for name, median in medians.items():
        breaks, count, seconds = zip(*first[name])
        ratio = f"{median / medians[reference]:.3f}" if reference in medians else "-"
        print(f"| {name} | {per_rank(breaks)} |{f' {per_rank(count)} |' if graphs else ''} {max(seconds):.1f} "
              f"| {1e3 * median:.2f} | {ratio} |")
    for name, why in failed.items():
        print(f"\n{name}: left out, it failed: {why}", end="")
    print("\n" if failed else "", end="")


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="dp",
                        help="dp: against DDP (an MLP); parameters: against FSDP2; pp: against torch's GPipe")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, help="default 512 (dp), 256 (parameters, pp)")
    parser.add_argument("--batch", type=int,
                        help="rows per rank (pp: half the global batch); default 32 (dp), 8 (parameters, pp)")
    parser.add_argument("--heads", type=int, default=4, help="the GPT's attention heads")
    parser.add_argument("--seq", type=int, default=64, help="the GPT's tokens per row")
    parser.add_argument("--vocab", type=int, default=256, help="the GPT's vocabulary")
    parser.add_argument("--microbatches", type=int, default=4, help="pp: micro-batches per step")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first (at least 1: "
                        "the compiled ones compile again there, dynamo having been reset for each first step)")
    args = parser.parse(quick={"layers": 2, "width": 64, "seq": 16, "steps": 2, "rounds": 2, "warmup": 1,
                               "backend": "aot_eager"})
    for option, value in DEFAULTS[args.layout].items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the compiled contenders compile again in it)")
    if args.layout == "pp" and (2 * args.batch % args.microbatches or args.layers < 2):
        parser.error("--layout pp: 2 x --batch must divide into --microbatches equal micro-batches, and --layers >= 2")
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
