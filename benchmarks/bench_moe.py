"""A mixture-of-experts model on 2 ranks: experts placed over the ranks (``ep=2``, alone and with the other parameters
split by ``shard="parameters"``) against data parallelism (every rank holds every expert) and ``shard="parameters"``
(every rank gathers every expert of a block for each use): step time, per-rank memory, and the all-to-all bytes
against the count from the routing.

What it measures
    Hugging Face Mixtral built from a config (``--layers`` 2 layers, hidden ``--hidden`` 128, ``--experts`` 8 experts
    of width ``--expert-width`` 512, top-2, 4 heads, eager attention, its default experts implementation), float32,
    a global batch of ``--rows`` 8 rows of ``--tokens`` 128 tokens, Adam. The four layouts are built in the same
    2 processes (gloo, 1 thread each) as the planner's trials build them (``autodist.planner.trial.Trial``: a copy of
    the model parallelized, this rank's rows of the batch, the step ``zero_grad``, forward, the mean of the logits
    plus the loss, backward, ``step``) and timed in interleaved blocks; per layout the slowest rank's median step,
    and its peak: what ``autodist.memory`` counts a rank holding at rest (parameters, gradients, optimizer state,
    autodist's buffers and shared memory) plus the most a step allocates above it. For ``ep=2`` the bytes each
    rank sent to the other in one step's all-to-alls (measured in the exchange) beside what
    ``autodist.explain(model, ep=2, example=batch)`` counts from the batch's routing.

How to run
    python benchmarks/bench_moe.py                # a minute on 2 cores
    python benchmarks/bench_moe.py --experts 16 --expert-width 1024
    python benchmarks/bench_moe.py --quick        # smoke run: a tiny model, few steps

How to read it
    One row per layout: its median step, its ratio to data parallelism's, its peak MB per rank and the ratio. ep
    holds half the experts (and their gradients and optimizer state) on each rank and moves each token to its
    experts and back; shard="parameters" holds half of every parameter at rest and gathers each block whole for
    its forward and backward; ep=2+parameters splits the other parameters too.
"""
from __future__ import annotations

import copy
import statistics
import sys

import harness  # benchmarks/harness.py, next to this file
import timing  # benchmarks/timing.py
import torch

import autodist
from autodist.ep.place import placement_of
from autodist.planner import trial
from autodist.planner.plan import Layout
from autodist.runtime import tree

LAYOUTS = {"dp": (Layout(dp=2), {}), "shard=parameters": (Layout(dp=2, shard="parameters"), {}),
           "ep=2": (Layout(dp=2), {"ep": 2}), "ep=2+parameters": (Layout(dp=2, shard="parameters"), {"ep": 2})}


def build(args) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.expert_width,
                                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                        num_local_experts=args.experts, num_experts_per_tok=2,
                                        max_position_embeddings=args.tokens, attn_implementation="eager",
                                        use_cache=False)
    return transformers.MixtralForCausalLM(config)


def worker(args) -> None:
    autodist.init()
    model = build(args)
    ids = torch.randint(0, 512, (args.rows, args.tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    made, steps = {}, {}
    for name, (layout, options) in LAYOUTS.items():
        made[name] = trial.Trial(model, batch, layout, autodist.parallelize, 2, autodist.rank(), 0, options)

        def step(t=made[name]) -> float:
            import time
            start = time.perf_counter()
            t.run()
            return time.perf_counter() - start
        steps[name] = step
    placement = placement_of(made["ep=2"].model)
    for placed in placement.modules:
        placed.meter.forward = placed.meter.backward = 0
    made["ep=2"].optimizer.zero_grad()
    tree.call(made["ep=2"].model, made["ep=2"].x)["loss"].backward()  # a step's exchanges, the weights unchanged
    measured = (sum(p.meter.forward for p in placement.modules), sum(p.meter.backward for p in placement.modules))
    # the routing of the weights that step ran with (the trial has stepped): the copy is the whole model (gathers)
    plan = autodist.explain(copy.deepcopy(made["ep=2"].model), ep=2, example=batch)
    counted = [layer.sent(autodist.rank()) for layer in plan.layers]
    counted_total = (sum(f for f, _ in counted), sum(b for _, b in counted))
    times, _ = timing.interleave(steps, args.steps, args.rounds, args.warmup)
    medians = {}
    for name, ts in times.items():
        t = torch.tensor([statistics.median(ts)])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        medians[name] = float(t)
    sent = torch.tensor([*measured, *counted_total], dtype=torch.float64)
    torch.distributed.all_reduce(sent, op=torch.distributed.ReduceOp.MAX)
    if autodist.rank() == 0:
        experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
        print(f"\nMixtral: {sum(p.numel() for p in model.parameters()):,} parameters ({experts:,} in {args.experts} "
              f"experts x {args.layers} layers), {args.rows} rows x {args.tokens} tokens a step, 2 ranks")
        print(f"{'layout':<18}{'step ms':>10}{'x dp':>8}{'peak MB':>10}{'x dp':>8}")
        for name in LAYOUTS:
            print(f"{name:<18}{1e3 * medians[name]:>10.1f}{medians[name] / medians['dp']:>8.2f}"
                  f"{made[name].peak / 1e6:>10.1f}{made[name].peak / made['dp'].peak:>8.2f}")
        print(f"ep=2 all-to-all, the busiest rank in one step: sent {sent[0] / 1e6:.3f} MB forward, "
              f"{sent[1] / 1e6:.3f} MB backward; counted from the routing (explain): {sent[2] / 1e6:.3f} MB, "
              f"{sent[3] / 1e6:.3f} MB")
        print(plan)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)
    parser.blocks(steps=3, rounds=6, warmup=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "hidden": 32, "expert_width": 64, "rows": 4,
                               "tokens": 16})
    return harness.run(parser, args, worker)


if __name__ == "__main__":
    sys.exit(main())
