"""Data parallelism against no communication at all: autodist and DDP over the step of a rank training alone.

What it measures
    Two ranks (torchrun, gloo, CPU, 1 thread each). The floor is the same
    training step with no communication at all: each rank trains its own copy
    on its own part of the batch, both at once, as they would in the parallel
    run. Each rank holds three copies of one seeded model, on the one default
    process group: ``alone`` (the plain model), ``ddp``
    (``DistributedDataParallel``) and ``autodist`` (``autodist.parallelize``);
    it feeds all three the same fixed per-rank batch (built before timing) and
    alternates blocks of steps of each, the order turning every round, after a
    warm-up. Shapes (``--only``), those of ``bench_dp.py`` and ``bench_shapes.py``:
      mlp      the MLP 3072-2048-2048-10, 64 rows per rank (42 MB of gradients)
      nosync   the same MLP, 4 micro-batches of 64 rows per rank per optimizer
               step, the first 3 backwards inside no_sync
      tfm2     a pre-norm transformer LM, 2 layers, d 128, 16 x 64 tokens per rank
      tfm12    the same with 12 layers
      resnet   ResNet-20 with BatchNorm, 32 images per rank
      mp2      model parallelism: the MLP split by ``parallelize(model, mp=2)``
               (both ranks, the same 128 rows), against torch's tensor
               parallelism (``parallelize_module``, Megatron's pair, the last
               layer replicated, as autodist's plan) as the peer; the floor is
               the plain model of one rank's shard of every layer (3072-1024,
               1024-2048, 2048-10) run with no collective.
    A timed step is the whole optimizer step: zero_grad, forward, loss,
    backward (with its communication), SGD step. After each shape, DDP's and
    autodist's parameters are checked to agree (rtol 1e-4); for mp2, the
    losses of torch TP and autodist.

    Then a breakdown: ``--breakdown`` more steps of each contender, with the
    forward, the backward and the optimizer step timed apart, and inside
    autodist's backward what its gradient sync spends: packing the buckets
    (into the shared slot), waiting for the other rank (the all-reduces of one
    number before and after the sum, or gloo's all-reduce of the buckets),
    summing its part, unpacking (gradients as views of the bucket, or copied
    back into autograd's tensors).
    The breakdown's clocks cost a little; its steps are not in the headline.

    Last, the floor of the exchange on this machine, where the ranks share its
    cores and memory: autodist's exchange passes over the gradients' G bytes
    twice after a single backward (packing into the shared slot; the sum,
    which reads and writes each byte once; the gradients become views of the
    slot), 2 (N-1)/N + 1 times on N ranks after accumulation (packing only the
    parts the other ranks sum; the sum, this rank's own part made in
    autograd's gradients themselves; copying the other parts back), three
    times for a model of under 4 MB of gradients (packed whole and copied
    back whole); the floor is that many copies of G bytes timed with every
    rank copying at once, and "alone + floor" the step no exchange of these
    bytes can beat here.
    And the floor of any synchronous step: "alone in lockstep" takes, for each
    step, the slower rank's time of the ranks training alone (their jitter),
    over rank 0's median: a step that waits for every rank pays that much with
    no communication at all. The two together, "lockstep + floor" (alone in
    lockstep, plus the exchange floor's milliseconds over alone's step), is
    the floor of a synchronous step with this exchange on this machine; the
    last column is how far autodist is above it.

How to run
    python benchmarks/bench_floor.py                   # every shape, about 8 minutes on 2 idle cores
    python benchmarks/bench_floor.py --only mlp,tfm12  # some of them
    python benchmarks/bench_floor.py --quick           # smoke run of seconds, timing nothing

How to read it
    Per shape, each contender's line (min, quartiles, median in ms, rank 0's
    clock), then autodist / alone and DDP / alone, ratios of medians with the
    paired per-round ratio beside each (it cancels slow drift of the machine:
    when it disagrees with the headline the run was noisy). The goal is
    autodist / alone <= 1.10. A markdown table of the ratios and one of the
    breakdowns close the run. Run on an idle machine: the ranks share its cores.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Any, Callable

import bench_shapes  # benchmarks/bench_shapes.py: the shapes' workloads
import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import describe, interleave  # benchmarks/timing.py
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from workload import build_model, random_batch  # benchmarks/workload.py

import autodist
from autodist.dp.exchange import AllReduce
from autodist.dp.grad_sync import state_of

RANKS = 2
GOAL = 1.10
Batch = tuple[torch.Tensor, torch.Tensor]
WORKLOADS = {"mlp": bench_shapes.Workload(lambda: build_model(seed=0), random_batch, 128, 10),
             **{name: bench_shapes.WORKLOADS[name] for name in ("nosync", "tfm2", "tfm12", "resnet")}}
SHAPES = [*WORKLOADS, "mp2"]


class Phases:
    """Seconds spent per phase, step by step: ``with phases("forward"): ...``, and methods timed where wrapped."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.on = False

    def __call__(self, name: str) -> Any:
        return _Timed(self, name) if self.on else nullcontext()

    def wrap(self, owner: Any, method: str, name: str) -> None:
        """Time ``owner.method`` as phase ``name`` from now on (an instance attribute shadows the class's)."""
        inner = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self(name):
                return inner(*args, **kwargs)

        setattr(owner, method, timed)

    def end_step(self) -> None:
        if self.on:
            self.steps.append(dict(self.current))
        self.current.clear()

    def medians(self) -> dict[str, float]:
        names = {n for step in self.steps for n in step}
        return {n: statistics.median(step.get(n, 0.0) for step in self.steps) for n in names}


class _Timed:
    def __init__(self, phases: Phases, name: str) -> None:
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.phases.current[self.name] += time.perf_counter() - self.start


def training_step(model: nn.Module, micro: list[Batch], no_sync: Callable[[], Any], phases: Phases
                  ) -> Callable[[], float]:
    """One optimizer step over ``micro`` (all but the last backward inside ``no_sync()``), timed as a whole and
    by phase where ``phases`` is on."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        for k, (x, y) in enumerate(micro):
            with no_sync() if k < len(micro) - 1 else nullcontext():
                with phases("forward"):
                    loss = F.cross_entropy(_plain(model(x)), y)
                with phases("backward"):
                    loss.backward()
        with phases("step"):
            optimizer.step()
        phases.end_step()
        return time.perf_counter() - start

    return step


def _plain(t: torch.Tensor) -> torch.Tensor:
    """torch TP may hand back an AsyncCollectiveTensor still in flight: wait for it inside the forward."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def instrument(model: nn.Module, phases: Phases) -> None:
    """Time autodist's gradient sync by phase: the buckets' packing and unpacking, and the exchange's parts."""
    sync = state_of(model)
    if sync is None:
        return
    for bucket in sync.buckets:
        phases.wrap(bucket, "pack", "pack")
        phases.wrap(bucket, "unpack", "unpack")
    exchange = sync._ready_exchange()
    if isinstance(exchange, AllReduce):
        phases.wrap(exchange, "finish", "wait")
    else:
        phases.wrap(exchange.fence, "wait", "wait")
        phases.wrap(exchange, "_sum_my_parts", "sum")


def dp_contenders(work: bench_shapes.Workload, rank: int, phases: dict[str, Phases]
                  ) -> tuple[dict[str, nn.Module], dict[str, Callable[[], float]]]:
    reference = work.build()
    alone, contender = copy.deepcopy(reference), copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference)
    # BatchNorm with each rank's statistics, as DDP's and the lone rank's: the same computation timed
    contender, shards = autodist.parallelize(contender, bench_shapes.global_batches(work), batch_norm="local")
    micro = list(shards)
    models = {"alone": alone, "ddp": ddp, "autodist": contender}
    contexts = {"alone": nullcontext, "ddp": ddp.no_sync, "autodist": lambda: autodist.no_sync(contender)}
    steps = {name: training_step(m, micro, contexts[name], phases[name]) for name, m in models.items()}
    return models, steps


def shard_floor(split: nn.Sequential) -> nn.Sequential:
    """One rank's shard of every layer of ``split`` as a plain model: each layer with a 2-D weight becomes an
    ``nn.Linear`` of the local weight's shape, the rest is kept."""
    layers = []
    for layer in split:
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            layers.append(nn.Linear(weight.shape[1], weight.shape[0], bias=getattr(layer, "bias", None) is not None))
        else:
            layers.append(copy.deepcopy(layer))
    return nn.Sequential(*layers)


def mp_contenders(phases: dict[str, Phases]) -> tuple[dict[str, nn.Module], dict[str, Callable[[], float]]]:
    dense = build_model(seed=0)
    x, y = random_batch(128, seed=1)  # the same full batch on both ranks: pure model parallelism
    mesh = init_device_mesh("cpu", (RANKS,))
    tp = parallelize_module(copy.deepcopy(dense), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    contender, _ = autodist.parallelize(copy.deepcopy(dense), mp=RANKS)
    assert isinstance(contender, nn.Sequential), type(contender)
    models = {"alone": shard_floor(contender), "ddp": tp, "autodist": contender}
    steps = {name: training_step(m, [(x, y)], nullcontext, phases[name]) for name, m in models.items()}
    return models, steps


def check_agree(shape: str, models: dict[str, nn.Module]) -> None:
    """The peer and autodist trained alike: their parameters (data parallel) or losses (mp2) agree."""
    if shape == "mp2":
        x, y = random_batch(128, seed=1)
        with torch.no_grad():
            losses = [F.cross_entropy(_plain(models[n](x)), y) for n in ("ddp", "autodist")]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
        return
    for (name, theirs), ours in zip(models["ddp"].module.named_parameters(), models["autodist"].parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"autodist and DDP disagree on {n} after the run: {m}")


def copy_seconds(nbytes: int, repeats: int = 10) -> float:
    """Median seconds for this rank to copy ``nbytes`` into a buffer of its own, every rank copying at once: one
    pass over the gradients at the memory bandwidth a rank gets while the others use theirs."""
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # its pages are in
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exchange_floor(model: nn.Module, micro_batches: int) -> tuple[int, float, float] | None:
    """What autodist's exchange must move on this machine, where the ranks share its cores and memory: the
    gradients' bytes G, the passes over them (packing the other ranks' parts into the shared slot, the sum,
    which reads and writes each byte once, and copying the other ranks' parts back into autograd's tensors after
    accumulation; a small model's packed and copied back whole), and the milliseconds of that many copies of G.
    None where the model has no gradient sync (mp2)."""
    sync = state_of(model)
    if sync is None:
        return None
    nbytes = sum(p.numel() * p.element_size() for p in sync.params)
    others = (dist.get_world_size() - 1) / dist.get_world_size()  # the share of a bucket the other ranks sum
    if any(b.copies_back for b in sync.buckets):  # a small model: packed whole, copied back whole
        passes = 3.0
    else:  # after accumulation the own part is summed in the gradients; the gradients become views otherwise
        passes = others + 1 + others if micro_batches > 1 else 2.0
    return nbytes, passes, passes * copy_seconds(nbytes)


def lockstep_ratio(alone: list[float]) -> float:
    """The ranks training alone, as if each step waited for the slower rank: the median over steps of the
    slowest rank's time of that step, over rank 0's median. Any synchronous step pays this much for the ranks'
    jitter (a collective over all ranks). A collective over the default group: every rank calls it."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, alone)
    return statistics.median(map(max, zip(*every))) / statistics.median(alone)


def synchronous_floor(lockstep: float, floor: tuple[int, float, float] | None, alone: float) -> float:
    """The floor of a synchronous step with autodist's exchange, over alone's step: the ranks' jitter
    (``lockstep``), then the exchange's copies (``floor``'s seconds) on top of the slower rank's step."""
    return lockstep + (0.0 if floor is None else floor[2] / alone)


def block_medians(times: list[float], block: int) -> list[float]:
    return [statistics.median(times[i:i + block]) for i in range(0, len(times), block)]


def run_shape(shape: str, args: argparse.Namespace, rank: int) -> dict[str, Any] | None:
    phases = {name: Phases() for name in ("alone", "ddp", "autodist")}
    work = WORKLOADS.get(shape)
    models, steps = mp_contenders(phases) if work is None else dp_contenders(work, rank, phases)
    block = args.steps or (work.steps if work is not None else 10)
    times, _ = interleave(steps, block, args.rounds, args.warmup, before_block=dist.barrier)
    check_agree(shape, models)
    instrument(models["autodist"], phases["autodist"])
    for name, step in steps.items():
        dist.barrier()
        phases[name].on = True
        for _ in range(args.breakdown):
            step()
        phases[name].on = False
    floor = exchange_floor(models["autodist"], work.micro_batches if work is not None else 1)
    lockstep = lockstep_ratio(times["alone"])
    if rank != 0:
        return None
    peer = "torch-tp" if shape == "mp2" else "ddp"
    print(f"{shape}: {sum(p.numel() for p in models['alone'].parameters()):,} parameters per rank, "
          f"{args.rounds} rounds of {block} steps")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    floor_blocks = block_medians(times["alone"], block)
    ratios = {}
    for name, ts in times.items():
        print(describe(peer if name == "ddp" else name, ts))
    for name in ("autodist", "ddp"):
        paired = statistics.median(b / f for b, f in zip(block_medians(times[name], block), floor_blocks))
        ratios[name] = (medians[name] / medians["alone"], paired)
        label = peer if name == "ddp" else name
        goal = f"  (goal <= {GOAL:.2f}: {'met' if ratios[name][0] <= GOAL else 'NOT met'})" if name == "autodist" else ""
        print(f"  {label} / alone: {ratios[name][0]:.3f}  paired {paired:.3f}{goal}")
    print(f"  {'losses' if shape == 'mp2' else 'parameters'} of {peer} and autodist agree after the run", flush=True)
    print(f"  alone in lockstep (each step the slower rank's): {lockstep:.3f} of alone", flush=True)
    if floor is not None:
        nbytes, passes, seconds = floor
        print(f"  exchange floor: {passes:g} passes over {nbytes / 2**20:.1f} MiB of gradients = {1e3 * seconds:.1f} ms "
              f"(both ranks copying at once); alone + floor = {1 + seconds / medians['alone']:.3f} of alone",
              flush=True)
    both = synchronous_floor(lockstep, floor, medians["alone"])
    print(f"  lockstep + floor: {both:.3f} of alone; autodist {ratios['autodist'][0] - both:+.3f} above it", flush=True)
    print(flush=True)
    return {"medians": medians, "ratios": ratios, "phases": {n: p.medians() for n, p in phases.items()},
            "peer": peer, "floor": floor, "lockstep": lockstep, "synchronous": both}


PHASE_ORDER = ("forward", "backward", "pack", "wait", "sum", "unpack", "step")


def tables(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| shape | alone ms | autodist ms | peer ms | autodist / alone (paired) | peer / alone (paired) "
            "| alone in lockstep / alone | exchange floor ms | (alone + floor) / alone | lockstep + floor "
            "| autodist above it |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, r in results.items():
        m, (ours, ours_p), (theirs, theirs_p) = r["medians"], r["ratios"]["autodist"], r["ratios"]["ddp"]
        floor = "| - | -" if r["floor"] is None else \
            f"| {1e3 * r['floor'][2]:.1f} ({r['floor'][1]:g} x {r['floor'][0] / 2**20:.1f} MiB) " \
            f"| {1 + r['floor'][2] / m['alone']:.3f}"
        both = r["synchronous"]
        rows.append(f"| {shape} | {1e3 * m['alone']:.1f} | {1e3 * m['autodist']:.1f} | {1e3 * m['ddp']:.1f} "
                    f"({r['peer']}) | **{ours:.3f}** ({ours_p:.3f}) | {theirs:.3f} ({theirs_p:.3f}) "
                    f"| {r['lockstep']:.3f} {floor} | {both:.3f} | {ours - both:+.3f} |")
    rows += ["", "Breakdown, median ms per step (pack ... unpack are inside autodist's backward):", "",
             "| shape | contender | " + " | ".join(PHASE_ORDER) + " |", "|---|---|" + "---|" * len(PHASE_ORDER)]
    for shape, r in results.items():
        for name in ("alone", "ddp", "autodist"):
            got = r["phases"][name]
            cells = [f"{1e3 * got[p]:.1f}" if p in got else "" for p in PHASE_ORDER]
            rows.append(f"| {shape} | {r['peer'] if name == 'ddp' else name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_worker(args: argparse.Namespace) -> None:
    world = autodist.init()
    assert world.size == RANKS, f"expected {RANKS} ranks, got {world.size}"
    if world.rank == 0:
        print(f"{RANKS} ranks (gloo, {args.threads} thread(s) each), {args.rounds} rounds, warm-up {args.warmup}\n",
              flush=True)
    results = {}
    for shape in args.only:
        result = run_shape(shape, args, world.rank)
        if result is not None:
            results[shape] = result
    if world.rank == 0:
        print(tables(results), flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True)
    parser.add_argument("--only", type=harness.some_of(SHAPES), default=SHAPES,
                        help=f"comma-separated shapes, of {','.join(SHAPES)} (default: all)")
    parser.blocks(steps=0, rounds=20, warmup=3, min_steps=0,
                  steps_help="steps per block for every shape (default 0: per shape, as bench_shapes.py, mlp and "
                             "mp2 10)")
    parser.add_argument("--breakdown", type=int, default=10, help="steps of each contender timed by phase")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "breakdown": 1})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
