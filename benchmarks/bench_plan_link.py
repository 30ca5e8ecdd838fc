"""The plan under a throttled link: predicted from a fast link's measures, then measured on the slow one.

What it measures
    Two hosts (``tests/cluster.py``: network namespaces joined by a veth pair, one rank on each, gloo over the
    link) and an MLP of ``--layers`` Linear layers of width ``--width`` with ReLU between, a global batch of
    ``--batch`` rows (float32, Adam). First the link as it is: ``autodist.plan(..., Auto(finalists=64))`` measures
    every fitting layout there (its pick: the measured fastest), and ``autodist.plan(..., target=Target(ranks=2,
    link_gbps=R))`` predicts the same world with the link at ``--rate`` (``R``, its bytes a second; the latency
    the one measured, none tried). Then the link is rate-limited to ``--rate`` (``tc tbf``) and every layout is
    measured again. Printed: each layout's step on the fast link, predicted for the slow one and measured there;
    the fast link's pick, the predicted pick for the slow link and the measured fastest there (goals: the pick
    changes, and the predicted one is the fastest measured on the slow link, within 1.10x).

How to run (root, with iproute2: it makes the namespaces)
    python benchmarks/bench_plan_link.py                      # 100mbit, about 2 minutes
    python benchmarks/bench_plan_link.py --rate 20mbit --width 256
    python benchmarks/bench_plan_link.py --quick              # smoke run: a small model, few steps
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

import bench_slow_link as slow_link  # next to this file: the two hosts' launch
import harness  # benchmarks/harness.py
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist

_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def rate_bytes(rate: str) -> float:
    """Bytes a second of a ``tc`` rate such as ``100mbit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if match is None:
        raise ValueError(f"--rate must read like 100mbit, 20mbit or 1gbit, got {rate!r}")
    return float(match[1]) * _UNITS[match[2]]


def _model_and_data(args) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * args.batch, args.width, generator=g)
    return nn.Sequential(*layers[:-1]), DataLoader(TensorDataset(x), batch_size=args.batch)


def worker(args) -> None:
    out = pathlib.Path(args.out)
    model, data = _model_and_data(args)
    auto = autodist.Auto(finalists=64, steps=args.steps)  # every fitting layout measured
    plan = autodist.plan(model, data, auto)
    if args.phase == "fast":
        slow = autodist.Target(ranks=2, link_gbps=rate_bytes(args.rate) / 1e9)
        predicted = autodist.plan(model, data, auto, target=slow)
        if autodist.rank() == 0:
            (out / "predicted-slow.json").write_text(predicted.to_json())
    if autodist.rank() == 0:
        (out / f"measured-{args.phase}.json").write_text(plan.to_json())


def _report(out: pathlib.Path, rate: str) -> int:
    fast, slow, predicted = (autodist.ParallelPlan.from_json((out / f"{name}.json").read_text())
                             for name in ("measured-fast", "measured-slow", "predicted-slow"))
    timed = {r.label: r for r in slow.rows if r.measured_seconds is not None}
    before = {r.label: r for r in fast.rows if r.measured_seconds is not None}
    guess = {r.label: r for r in predicted.rows}
    print(f"\n{'layout':<44} {'fast link':>10} {'slow: predicted':>16} {'slow: measured':>15} {'error':>7}")
    errors = []
    for label, r in timed.items():
        errors.append(guess[label].seconds / r.measured_seconds - 1)
        was = f"{1e3 * before[label].measured_seconds:8.1f}ms" if label in before else "-"
        print(f"{label:<44} {was:>10} {1e3 * guess[label].seconds:14.1f}ms {1e3 * r.measured_seconds:13.1f}ms "
              f"{100 * errors[-1]:+6.0f}%")
    fastest = min(timed.values(), key=lambda r: r.measured_seconds)
    pick = next(r.label for r in predicted.rows if r.status == "chosen")
    ratio = timed[pick].measured_seconds / fastest.measured_seconds if pick in timed else float("nan")
    changed = fast.layout != predicted.layout
    print(f"\nfast link: pick {fast.layout}; {rate}: predicted pick {predicted.layout} "
          f"({'changed' if changed else 'unchanged'}), measured fastest {fastest.layout}; the predicted pick "
          f"x{ratio:.2f} the fastest (goal: within 1.10x); step error {100 * min(errors):+.0f}% to "
          f"{100 * max(errors):+.0f}%")
    return 0


def launch(parser: harness.Parser, args: argparse.Namespace) -> int:
    """The two hosts: every layout measured on the link as it is, then rate-limited; then the table."""
    cluster = slow_link.two_hosts("bench_plan_link", args.quick)
    if cluster is None:
        return 0 if args.quick else 2
    with cluster, tempfile.TemporaryDirectory() as out:
        for phase in ("fast", "slow"):
            if phase == "slow":
                cluster.limit(args.rate)
            options = argparse.Namespace(**vars(args) | {"out": out, "phase": phase})
            codes = slow_link.run_on_hosts(cluster, parser.script, parser.forwarded(options))
            if any(codes):
                print(f"bench_plan_link: the {phase} link's job failed (exit status {codes} on hosts A, B)",
                      file=sys.stderr)
                return 1
        return _report(pathlib.Path(out), args.rate)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2)  # one rank on each host
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate of the slow link, e.g. 100mbit or 20mbit")
    parser.add_argument("--width", type=int, default=128, help="the MLP's width")
    parser.add_argument("--layers", type=int, default=16, help="the MLP's Linear layers")
    parser.add_argument("--batch", type=int, default=16, help="global batch, rows")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each measured layout")
    parser.add_argument("--phase", default="fast", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse(quick={"width": 32, "steps": 2, "layers": 4})
    rate_bytes(args.rate)  # a rate that does not parse fails here, before any host is made
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
