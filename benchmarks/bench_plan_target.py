"""A plan for a world that is not here: predicted from 2 ranks' measures, then measured in that world.

What it measures
    The nanoGPT-style decoder of ``bench_plan.py`` (4 layers of width ``--width``, 4 heads, 64 tokens, a global
    batch of 16; float32, Adam). First each world of ``--worlds`` is launched: ``autodist.plan`` with every
    fitting layout a finalist (measured on a copy of the model, interleaved, the slowest rank's median step and its
    peak), and that world's link measured as the planner measures one (an all-reduce's latency and bandwidth).
    Then, on 2 ranks, ``autodist.plan(..., target=autodist.Target(ranks=N, speed=S))`` for each N: every layout
    of N ranks predicted (memory per rank, step time), none tried, twice: with the link carried from the 2 ranks
    (scaled by ``S``), and with the link measured in that world given (``link_gbps``, ``latency_us``), as a user
    sizing a cluster gives theirs. ``S`` says how fast a rank of that world computes against one here: N ranks
    on this machine's C cores get min(C, N) / N of them each, against min(C, 2) / 2 for the 2 ranks that
    measured. Per world and link: each measured layout's predicted and measured peak and step, their errors, and
    whether the predicted pick is the measured fastest (goals: peak within 10%, step within 20%).

How to run
    python benchmarks/bench_plan_target.py                 # measures 3 and 4 ranks, then predicts them from 2
    python benchmarks/bench_plan_target.py --worlds 4 --width 256
    python benchmarks/bench_plan_target.py --quick         # smoke run: a small model, few steps
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import harness  # benchmarks/harness.py, next to this file
from gpt_block import GPT  # benchmarks/gpt_block.py
import torch
from torch.utils.data import DataLoader, TensorDataset

import autodist


def _model_and_data(args) -> tuple[torch.nn.Module, DataLoader]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = GPT(vocab=256, width=args.width, heads=4, layers=4, seq=64)
    return model, DataLoader(TensorDataset(torch.randint(0, 256, (64, 64), generator=g)), batch_size=16)


def speed(ranks: int, cores: int | None = None) -> float:
    """How fast a rank of ``ranks`` on this machine computes against one of the 2 that measure."""
    cores = cores or os.cpu_count() or 1
    return (min(cores, ranks) / ranks) / (min(cores, 2) / 2)


def _link(out: pathlib.Path) -> None:
    """This world's link, as a user sizing a cluster knows theirs (an all-reduce benchmark): one hop's latency and
    the ring's bandwidth, measured as the planner measures the world it runs in."""
    from autodist.planner.profile import link_time
    latency, bandwidth, _ = link_time(torch.device("cpu"))
    ranks = autodist.world_size()
    if autodist.rank() == 0:
        (out / f"link-{ranks}.json").write_text(json.dumps(
            {"latency_us": 1e6 * latency / (2 * (ranks - 1)), "link_gbps": bandwidth / 1e9}))


def worker(args) -> None:
    out = pathlib.Path(args.out)
    model, data = _model_and_data(args)
    if args.predict:
        for ranks in args.worlds:
            link = json.loads((out / f"link-{ranks}.json").read_text())
            for kind, target in (("carried", autodist.Target(ranks=ranks, speed=speed(ranks))),
                                 ("given", autodist.Target(ranks=ranks, speed=speed(ranks), **link))):
                plan = autodist.plan(model, data, target=target)
                if autodist.rank() == 0:
                    (out / f"predicted-{kind}-{ranks}.json").write_text(plan.to_json())
        return
    auto = autodist.Auto(finalists=64, steps=args.steps)  # every fitting layout measured
    plan = autodist.plan(model, data, auto)
    _link(out)  # after the plan, which joined the process group
    if autodist.rank() == 0:
        (out / f"measured-{autodist.world_size()}.json").write_text(plan.to_json())


def _report(out: pathlib.Path, ranks: int) -> None:
    measured = autodist.ParallelPlan.from_json((out / f"measured-{ranks}.json").read_text())
    link = json.loads((out / f"link-{ranks}.json").read_text())
    rows = [r for r in measured.rows if r.measured_seconds is not None]
    fastest = min(rows, key=lambda r: r.measured_seconds)
    print(f"\n== {ranks} ranks, predicted from 2 (speed {speed(ranks):.2f}); measured fastest {fastest.layout}; "
          f"the link measured there: {link['latency_us']:.0f} us a hop, {link['link_gbps']:.2f} GB/s ==")
    for kind, what in (("carried", "the link carried from 2 ranks"), ("given", "the target's link given")):
        predicted = autodist.ParallelPlan.from_json((out / f"predicted-{kind}-{ranks}.json").read_text())
        by_layout = {r.label: r for r in predicted.rows}  # with pp, each count of micro-batches a layout of its own
        print(f"  -- {what}: predicted pick {predicted.layout}")
        peaks, times = [], []
        for r in rows:
            guess = by_layout[r.label]
            peaks.append(guess.peak / r.measured_peak - 1)
            times.append(guess.seconds / r.measured_seconds - 1)
            print(f"  {r.label:<62} peak {guess.peak / 1e6:7.1f} / {r.measured_peak / 1e6:7.1f} MB "
                  f"({100 * peaks[-1]:+5.1f}%)  step {1e3 * guess.seconds:7.1f} / {1e3 * r.measured_seconds:7.1f} ms "
                  f"({100 * times[-1]:+4.0f}%)")
        pick = next(r for r in predicted.rows if r.status == "chosen").label
        chosen = next((r for r in rows if r.label == pick), None)
        ratio = f"x{chosen.measured_seconds / fastest.measured_seconds:.2f} the fastest" if chosen else "not measured"
        print(f"{ranks} ranks, {what}: worst peak error {100 * max(peaks, key=abs):+.1f}% (goal within 10%), "
              f"worst step error {100 * max(times, key=abs):+.0f}% (goal within 20%), the predicted pick {ratio}")


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[3, 4],
                        help="the world sizes predicted from 2 ranks, then measured")
    parser.add_argument("--width", type=int, default=256, help="the decoder's width")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each measured layout")
    parser.add_argument("--predict", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse(quick={"width": 32, "steps": 2, "worlds": [3]})
    if args.worker:
        harness.run(parser, args, worker)
        return 0
    with tempfile.TemporaryDirectory() as out:
        argv = [w for w in parser.forwarded(args) if not w.startswith("--out")] + [f"--out={out}"]
        for ranks in args.worlds:  # first the worlds themselves: their links are given to the second prediction
            if harness.torchrun(parser.script, ranks, argv) != 0:
                return 1
        if harness.torchrun(parser.script, 2, [*argv, "--predict"]) != 0:
            return 1
        for ranks in args.worlds:
            _report(pathlib.Path(out), ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
