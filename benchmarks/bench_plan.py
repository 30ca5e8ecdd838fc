"""plan="auto" against the ground truth: every layout that fits, measured side by side, beside the chooser's pick.

What it measures
    For each model, on ``--ranks`` CPU ranks (gloo), float32, Adam (the plan's default assumption):

    * ``mlp``: 8 x Linear(1024, 1024) with ReLU, a global batch of 64;
    * ``gpt``: a nanoGPT-style decoder, 4 layers of width 256, 4 heads, 64 tokens, a global batch of 16;
    * ``long``: the same decoder at width 128 on long sequences (``--long-seq``, 1,024 tokens) and a global batch
      of ``--long-batch`` rows (1): context parallelism's case;
    (the decoders are planned with ``Auto(cp=True)``: their ``cp`` layouts among the candidates.)
    * ``cnn``: a stem and 4 residual blocks of 3x3 convolutions (64 channels) on 32x32 images, a Linear
      head, a global batch of 32;
    * ``tight``: the mlp under a memory budget of ``--tight-gb`` per rank, which its replicated layout does
      not fit (the plan must say so and pick one that does);
    * ``moe``: a Hugging Face Mixtral, 2 layers of width ``--moe-width`` (128), 8 experts of twice that, top-2,
      64 tokens, a global batch of 16: expert parallelism's case (``ep`` among the candidates).

    First ``autodist.plan`` (timed: the search, its progress lines, its table). Then the ground truth: every
    layout the plan found fitting is built on a copy of the same model (``parallelize`` with its options)
    and measured on the same global batch: its peak (``autodist.memory`` at rest plus the most a step makes
    above it), and its step time, all layouts in one set of processes, in interleaved blocks (medians).
    Per model: each layout's predicted and measured peak, its median step and its ratio to the fastest;
    the chosen layout's ratio to the fastest (goal <= 1.10) and the search's seconds (goal <= 60).

    ``--billion`` instead plans the 0.94 B-parameter MLP of ``bench_billion.py`` (14 x Linear(8192, 8192))
    on this machine's memory, prints the plan (replicated does not fit) and trains the chosen layout for
    ``--billion-steps`` steps.

How to run
    python benchmarks/bench_plan.py                       # 2 ranks, all six models, a few minutes on 2 cores
    python benchmarks/bench_plan.py --ranks 4
    python benchmarks/bench_plan.py --models gpt,tight
    python benchmarks/bench_plan.py --billion             # 2 ranks, about 20 GB of memory
    python benchmarks/bench_plan.py --quick               # smoke run: small models, few steps
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
from gpt_block import GPT  # benchmarks/gpt_block.py
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.mp import observe
from autodist.planner import trial

MODELS = ["mlp", "gpt", "long", "cnn", "tight", "moe"]


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class CNN(nn.Module):
    def __init__(self, channels: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(self.blocks(torch.relu(self.stem(x))), 4)
        return self.head(x.flatten(1))


def mlp(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def mixtral(width: int) -> nn.Module:
    import transformers  # only this model needs it

    config = transformers.MixtralConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                                        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager", use_cache=False, experts_implementation="eager")
    return transformers.MixtralForCausalLM(config)


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, DataLoader, autodist.Auto]:
    """The model (seeded alike on every rank), its data and the plan's settings."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name in ("mlp", "tight"):
        model = mlp(args.width, 8)
        data = TensorDataset(torch.randn(4 * args.mlp_batch, args.width, generator=g))
        batch = args.mlp_batch
    elif name == "gpt":
        model = GPT(vocab=256, width=args.gpt_width, heads=4, layers=4, seq=64)
        data = TensorDataset(torch.randint(0, 256, (4 * args.gpt_batch, 64), generator=g))
        batch = args.gpt_batch
    elif name == "long":
        model = GPT(vocab=256, width=args.gpt_width // 2, heads=4, layers=4, seq=args.long_seq)
        data = TensorDataset(torch.randint(0, 256, (4 * args.long_batch, args.long_seq), generator=g))
        batch = args.long_batch
    elif name == "moe":
        model = mixtral(args.moe_width)
        data = TensorDataset(torch.randint(0, 256, (4 * args.moe_batch, 64), generator=g))
        batch = args.moe_batch
    else:
        model = CNN(args.cnn_channels)
        data = TensorDataset(torch.randn(4 * args.cnn_batch, 3, 32, 32, generator=g))
        batch = args.cnn_batch
    auto = autodist.Auto(budget_gb=args.tight_gb if name == "tight" else None, cp=name in ("gpt", "long"))
    return model, DataLoader(data, batch_size=batch), auto


def _ground_truth(model: nn.Module, loader: DataLoader, plan: autodist.ParallelPlan, args: argparse.Namespace
                  ) -> dict[str, tuple[float, list[float]]]:
    """Every fitting layout on a copy, made and cut as the plan's trials make them (``cp``'s rows cut to this
    rank's tokens): its measured peak and its step times, interleaved with the others."""
    example = observe.example_of(loader, rows=plan.batch_size)
    steps, peaks = {}, {}
    for row in (r for r in plan.rows if r.fits):
        options = {"example": example} if row.layout.mp > 1 else {}
        if row.stages:  # the cut the plan predicted and tried, and its micro-batches
            options["stages"] = row.stages
        if row.microbatches:
            options["microbatches"] = row.microbatches
        made = trial.Trial(model, example, row.layout, autodist.parallelize, 2, autodist.rank(), 0, options)

        def step(made=made) -> float:
            start = time.perf_counter()
            made.run()
            return time.perf_counter() - start

        peaks[row.label], steps[row.label] = made.peak, step
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    slowest = {}
    for name, ts in times.items():  # the slowest rank's median
        t = torch.tensor([statistics.median(ts)])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        slowest[name] = float(t)
    return {name: (peaks[name], [slowest[name]]) for name in steps}


def bench(name: str, args: argparse.Namespace) -> tuple[float, float, float, float]:
    model, loader, auto = build(name, args)
    start = time.perf_counter()
    plan = autodist.plan(model, loader, auto)
    searched = time.perf_counter() - start
    truth = _ground_truth(model, loader, plan, args)
    best = min(t[0] for _, t in truth.values())
    chosen = truth[next(r for r in plan.rows if r.status == "chosen").label][1][0]
    errors = []
    if autodist.rank() == 0:
        print(f"\n== {name}: {sum(p.numel() for p in model.parameters()):,} parameters, {args.ranks} ranks ==")
        print(plan)
        print("ground truth (every fitting layout, interleaved; peak predicted / measured, MB per rank):")
        for row in (r for r in plan.rows if r.fits):
            peak, (median,) = truth[row.label]
            errors.append(row.peak / peak - 1)
            mark = "  <- chosen" if row.status == "chosen" else ""
            print(f"  {row.label:<62} peak {row.peak / 1e6:8.1f} / {peak / 1e6:8.1f} ({100 * errors[-1]:+5.1f}%)"
                  f"  median {1e3 * median:8.2f} ms  x{median / best:.2f}{mark}")
        worst = max(errors, key=abs)
        print(f"{name}: chosen {plan.layout}: x{chosen / best:.2f} the fastest (goal <= 1.10: "
              f"{'met' if chosen <= 1.10 * best else 'NOT met'}); search {searched:.1f} s (goal <= 60: "
              f"{'met' if searched <= 60 else 'NOT met'}); worst peak error {100 * worst:+.1f}% (goal within 10%)",
              flush=True)
        return chosen / best, searched, worst, 0.0
    return 0.0, 0.0, 0.0, 0.0


def billion(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = mlp(8192, 14) if not args.quick else mlp(512, 4)
    width = model[0].in_features
    loader = DataLoader(TensorDataset(torch.randn(16, width)), batch_size=args.billion_batch)
    start = time.perf_counter()
    plan = autodist.plan(model, loader)
    if autodist.rank() == 0:
        print(plan)
        print(f"searched in {time.perf_counter() - start:.1f} s", flush=True)
    model, loader = autodist.parallelize(model, loader, plan=plan)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step, (x,) in zip(range(args.billion_steps), loader):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if autodist.rank() == 0:
            print(f"step {step}: {time.perf_counter() - start:.1f} s", flush=True)
    print(autodist.memory(model, optimizer), flush=True)


def worker(args: argparse.Namespace) -> None:
    if args.billion:
        billion(args)
        return
    results = {name: bench(name, args) for name in args.models}
    if autodist.rank() == 0:
        print("\nsummary (chosen / fastest, search seconds, worst peak error):")
        for name, (ratio, searched, worst, _) in results.items():
            print(f"  {name:<6} x{ratio:.2f}  {searched:5.1f} s  {100 * worst:+.1f}%")


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.blocks(steps=3, rounds=6, warmup=2)
    parser.add_argument("--models", type=harness.some_of(MODELS), default=MODELS, help="which models")
    parser.add_argument("--width", type=int, default=1024, help="the mlp's width")
    parser.add_argument("--mlp-batch", type=int, default=64)
    parser.add_argument("--gpt-width", type=int, default=256)
    parser.add_argument("--gpt-batch", type=int, default=16)
    parser.add_argument("--long-seq", type=int, default=1024, help="the long model's tokens per row")
    parser.add_argument("--long-batch", type=int, default=1, help="the long model's rows per global batch")
    parser.add_argument("--cnn-channels", type=int, default=64)
    parser.add_argument("--cnn-batch", type=int, default=32)
    parser.add_argument("--tight-gb", type=float, default=0.12, help="the budget per rank of the 'tight' model")
    parser.add_argument("--moe-width", type=int, default=128, help="the moe model's width")
    parser.add_argument("--moe-batch", type=int, default=16)
    parser.add_argument("--billion", action="store_true", help="plan and train the 0.94 B-parameter MLP")
    parser.add_argument("--billion-batch", type=int, default=8)
    parser.add_argument("--billion-steps", type=int, default=2)
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "width": 128, "mlp_batch": 16,
                               "gpt_width": 64, "gpt_batch": 8, "long_seq": 128, "cnn_channels": 8, "cnn_batch": 8,
                               "tight_gb": 0.0022, "billion_steps": 1, "moe_width": 32, "moe_batch": 8})
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
