"""Step time of autodist's model parallelism (mp=2) against PyTorch's own tensor parallelism.

What it measures
    Two ranks (torchrun, gloo, CPU), pure model parallelism (world = mp = 2):
    the MLP 3072-2048-2048-10 (``nn.Sequential`` of Linear, ReLU, Linear, ReLU,
    Linear) split over both ranks
      - by ``autodist.parallelize(model, mp=2)`` (its plan is printed first), and
      - by ``torch.distributed.tensor.parallel.parallelize_module`` with
        ``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D ``DeviceMesh("cpu", [0, 1])``
        (``init_device_mesh("cpu", (2,))``).
    Both start from deep copies of one dense model built with a fixed seed, and
    every rank feeds the same full batch (default 128 rows): each rank computes
    its half of every split layer for all rows. Before timing, both models'
    outputs and loss on that batch are checked against the dense model.

    torch's plan for the first two layers is Megatron's pair (column-split,
    then row-split: one all-reduce forward). For the last layer (2048 -> 10)
    three plans are tried and the fastest is used (``--tp-plan`` forces one):
      colwise-last     ColwiseParallel(output_layouts=Replicate()): all-gather of
                       the 10 logits forward, all-reduce of the 2048-wide input
                       gradient backward
      rowwise-last     RowwiseParallel(input_layouts=Replicate()): all-reduce of
                       the logits forward, all-gather of the input gradient
                       backward (autodist's MPBaseLinear, were the layer named in
                       --mp-layers)
      replicated-last  left a plain nn.Linear on every rank: no collective
    The choice is made on rank 0 from a short interleaved run of the three
    (printed); taking the fastest of noisy trials can only favour torch. With
    ``--quick`` that trial is too short to choose reliably.

    Then each rank holds both contenders on the one default process group and
    alternates blocks of ``--steps`` steps of each, for ``--rounds`` rounds,
    after a warm-up. A timed step is the whole training step: zero_grad,
    forward, cross-entropy, backward, SGD step. At the end both models have
    taken the same steps on the same batch, and their losses are checked to
    still agree.

How to run
    python benchmarks/bench_mp.py            # 1 to 1.5 minutes on 2 idle cores
    python benchmarks/bench_mp.py --quick    # smoke run of seconds, timing nothing
    python benchmarks/bench_mp.py --tp-plan rowwise-last   # skip the choice of torch's plan
    python benchmarks/bench_mp.py --mp-layers 0,2          # autodist splits only these Linears
    python benchmarks/bench_mp.py --model gpt --batch 16   # the transformer case: a nanoGPT-style decoder,
                                                           # 4 layers, width 256, 16 x 128 tokens, against
                                                           # torch TP with torchtitan's plan (goal <= 1.00)

How to read it
    Each line gives min / first quartile / median / third quartile of the step
    time in milliseconds (rank 0's clock; the collectives keep the ranks in
    step). The headline is the ratio of medians, autodist / torch-tp: lower is
    better; the goal is <= 0.90. "paired" is the median over rounds of the ratio
    of the two blocks' medians in that round; it cancels slow drift of the
    machine (thermal, other load), so when it disagrees with the headline the
    run was noisy. The spread between min and median shows how noisy.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from typing import Callable

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import describe, interleave, make_step, report  # benchmarks/timing.py
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from workload import build_model, random_batch  # benchmarks/workload.py

import autodist

RANKS = 2  # world = mp: pure model parallelism
GOAL = 0.90
GPT_GOAL = 1.00

# torch's tensor-parallel plans, by the name printed and accepted by --tp-plan. Layers "0" and "2" are
# Megatron's pair in all of them; they differ in what happens to the last Linear ("4", 2048 -> 10).
TP_PLANS: dict[str, Callable[[], dict[str, ParallelStyle]]] = {
    "colwise-last": lambda: {"0": ColwiseParallel(), "2": RowwiseParallel(),
                             "4": ColwiseParallel(output_layouts=Replicate())},
    "rowwise-last": lambda: {"0": ColwiseParallel(), "2": RowwiseParallel(),
                             "4": RowwiseParallel(input_layouts=Replicate())},
    "replicated-last": lambda: {"0": ColwiseParallel(), "2": RowwiseParallel()},
}


def torch_tp(dense: nn.Module, mesh: DeviceMesh, plan: str) -> nn.Module:
    """A copy of ``dense`` split by torch's tensor parallelism with the named plan."""
    return parallelize_module(copy.deepcopy(dense), mesh, TP_PLANS[plan]())


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor (torch TP may hand back an AsyncCollectiveTensor, still in flight)."""
    return torch.Tensor(t.detach().clone())


def check_first_batch(dense: nn.Module, models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    """Every model's output and loss on the batch equal the dense model's (they start from its weights)."""
    with torch.no_grad():
        want = dense(x)
        want_loss = F.cross_entropy(want, y)
        for name, model in models.items():
            out = plain(model(x))
            torch.testing.assert_close(out, want, msg=lambda m, n=name: f"{n}: output differs from the dense model: {m}")
            torch.testing.assert_close(F.cross_entropy(out, y), want_loss,
                                       msg=lambda m, n=name: f"{n}: loss differs from the dense model: {m}")


def choose_tp_plan(dense: nn.Module, mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor,
                   args: argparse.Namespace, rank: int) -> str:
    """The fastest of TP_PLANS on this model (rank 0's clock decides), or the one --tp-plan names."""
    if args.tp_plan != "auto":
        return args.tp_plan
    models = {name: torch_tp(dense, mesh, name) for name in TP_PLANS}
    check_first_batch(dense, models, x, y)
    times, _ = interleave({name: make_step(m, x, y) for name, m in models.items()}, args.select_steps,
                          args.select_rounds, args.warmup, before_block=dist.barrier)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    choice = [min(medians, key=medians.__getitem__)]
    dist.broadcast_object_list(choice, src=0)  # the ranks' clocks may disagree; rank 0's choice holds
    if rank == 0:
        print(f"torch TP plan for the last layer, fastest of {len(TP_PLANS)} "
              f"({args.select_rounds} rounds of {args.select_steps} steps each):")
        for name, ts in times.items():
            print(describe(name, ts, width=max(map(len, TP_PLANS))) + ("   <- chosen" if name == choice[0] else ""))
        print(flush=True)
    return choice[0]


def final_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.cross_entropy(plain(model(x)), y)


def race(dense: nn.Module, reference: nn.Module, contender: nn.Module, x: torch.Tensor, y: torch.Tensor,
         args: argparse.Namespace) -> tuple[dict[str, list[float]], list[float], dict[str, torch.Tensor]]:
    """Both models checked against the dense one, then timed in interleaved blocks; their final losses agree."""
    models = {"torch-tp": reference, "autodist": contender}
    check_first_batch(dense, models, x, y)
    # The barrier lines the ranks up, so one rank's lag does not land in the next block's first step.
    times, paired = interleave({name: make_step(m, x, y) for name, m in models.items()},
                               args.steps, args.rounds, args.warmup, before_block=dist.barrier)
    losses = {name: final_loss(m, x, y) for name, m in models.items()}
    torch.testing.assert_close(losses["autodist"], losses["torch-tp"], rtol=1e-4, atol=1e-5)
    return times, paired, losses


def run_gpt_worker(args: argparse.Namespace, world: autodist.World, mesh: DeviceMesh) -> None:
    """The transformer case: autodist's automatic plan against torch TP with torchtitan's hand-written one."""
    import gpt_block  # benchmarks/gpt_block.py

    torch.manual_seed(0)
    device = harness.device_of(args)
    dense = gpt_block.GPT(layers=args.layers, seq=args.seq).to(device)
    x, y = (t.to(device) for t in gpt_block.batch(args.batch, args.seq))
    if world.rank == 0:
        print(f"autodist's plan, autodist.explain(model, mp={RANKS}, example=(x[:2],)):")
        print(autodist.explain(copy.deepcopy(dense), mp=RANKS, example=(x[:2],), batch_size=args.batch * args.seq),
              end="\n\n", flush=True)
    reference = parallelize_module(copy.deepcopy(dense), mesh, gpt_block.tp_plan(args.layers))
    gpt_block.local_heads(reference, RANKS)
    contender, _ = autodist.parallelize(copy.deepcopy(dense), mp=RANKS, example=(x[:2],))
    times, paired, _ = race(dense, reference, contender, x, y, args)
    if world.rank == 0:
        report(f"2 ranks (gloo, {args.threads} thread(s) each), mp=2, nanoGPT-style {args.layers} layers x width "
               f"256, batch {args.batch} x {args.seq} tokens on both, torch TP with torchtitan's plan:",
               times, paired, GPT_GOAL)


def run_worker(args: argparse.Namespace) -> None:
    """One of the two torchrun ranks: torch TP and autodist side by side on the same process group."""
    world = autodist.init()  # starts the gloo group that the device mesh then shares
    assert world.size == RANKS, f"expected {RANKS} ranks, got {world.size}"
    device = harness.device_of(args)
    mesh = init_device_mesh(device.type, (RANKS,))
    if args.model == "gpt":
        run_gpt_worker(args, world, mesh)
        return
    dense = build_model(seed=0).to(device)
    # One fixed batch, the same full batch on both ranks (pure model parallelism), reused:
    # data loading stays out of the timed step.
    x, y = (t.to(device) for t in random_batch(args.batch, seed=1))
    mp_layers = "all" if args.mp_layers == "all" else args.mp_layers.split(",")
    if world.rank == 0:
        option = "" if mp_layers == "all" else f", mp_layers={mp_layers}"
        print(f"autodist's plan, autodist.explain(model, mp={RANKS}{option}, batch_size={args.batch}):")
        print(autodist.explain(copy.deepcopy(dense), mp=RANKS, mp_layers=mp_layers, batch_size=args.batch),
              end="\n\n", flush=True)
    plan = choose_tp_plan(dense, mesh, x, y, args, world.rank)
    reference = torch_tp(dense, mesh, plan)
    contender, _ = autodist.parallelize(copy.deepcopy(dense), mp=RANKS, mp_layers=mp_layers)
    times, paired, losses = race(dense, reference, contender, x, y, args)
    if world.rank == 0:
        option = "" if mp_layers == "all" else f", autodist mp_layers={mp_layers}"
        report(f"2 ranks ({world.backend}, {device}, {args.threads} thread(s) each), mp=2, the same batch of "
               f"{args.batch} on both, "
               f"torch TP plan {plan}{option}:", times, paired, GOAL)
        steps = args.warmup + args.rounds * args.steps
        print(f"  after {steps} steps each, the loss on the batch agrees: torch-tp "
              f"{losses['torch-tp'].item():.6f}, autodist {losses['autodist'].item():.6f}", flush=True)


def main() -> int:
    """The two ranks through torchrun, in processes of their own."""
    parser = harness.Parser(__file__, __doc__, ranks=RANKS, threads=True, device=True)
    parser.blocks(steps=10, rounds=40, warmup=5)
    parser.add_argument("--batch", type=int, default=128, help="rows per step, the same on both ranks")
    parser.add_argument("--tp-plan", choices=["auto", *TP_PLANS], default="auto",
                        help="torch's plan for the last layer (auto: the fastest of a short trial run)")
    parser.add_argument("--mp-layers", default="all",
                        help="autodist's mp_layers: all (the default plan) or comma-separated Linear names, e.g. 0,2")
    parser.add_argument("--select-steps", type=int, default=5, help="steps per block when choosing torch's plan")
    parser.add_argument("--select-rounds", type=int, default=6, help="rounds when choosing torch's plan")
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                        help="mlp: the 3072-2048-2048-10 MLP; gpt: a nanoGPT-style decoder (width 256, 4 heads)")
    parser.add_argument("--layers", type=int, default=4, help="gpt: transformer blocks")
    parser.add_argument("--seq", type=int, default=128, help="gpt: tokens per row (--batch rows)")
    # --quick: tiny blocks, and a batch (gpt: of short rows) that makes a step cheap
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "select_steps": 1, "select_rounds": 2,
                               "batch": 8, "seq": 32})
    if args.select_steps < 1 or args.select_rounds < 2:
        parser.error("need --select-steps >= 1 and --select-rounds >= 2 (the quartiles need at least two values)")
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
