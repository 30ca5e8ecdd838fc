"""Parameter-server training (Downpour, EASGD) against exact sync on digits: accuracy, stragglers, a lost worker.

What it measures
    Three CPU ranks train bench_lowcomm's MLP 64-128-128-10 on scikit-learn's digits (its ``digits()``,
    ``mlp()`` and ``accuracy()``), global batch 32, SGD lr 0.05 momentum 0.9 (Downpour: lr 0.05 / 3, as
    every worker's gradient is a step of its own). Every step also sleeps ``--compute`` seconds (a stand-in
    for a real model's compute, so that one rank can be made slower):

    * accuracy at the same samples: ``--epochs`` epochs of exact sync, ``Downpour()`` and ``EASGD()``;
    * a straggler: rank 2 sleeps 3x as long per step; seconds until rank 0's model (after each of its
      passes: the exact model, or the servers' parameters) first reaches ``--target`` test accuracy;
    * a lost worker: rank 2 SIGKILLs itself in its second epoch; the others go on (Downpour);
    * server throughput: updates per second the server (rank 0) applies as 1, 2, 3 workers push
      (no sleep, ``--push-epochs`` epochs), the others only waiting.

    The ranks are started as ``mpirun`` would start them (Open MPI environment, rendezvous on a free port),
    not through ``autodist run``: torchrun stops every rank when one dies.

How to run
    python benchmarks/bench_param_server.py            # about two minutes on 2 cores
    python benchmarks/bench_param_server.py --epochs 4 # fewer epochs
    python benchmarks/bench_param_server.py --quick    # smoke run: 2 epochs, one run of each kind
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.nn.functional as F
from bench_lowcomm import BATCH, LR, MOMENTUM, accuracy, digits, mlp  # benchmarks/bench_lowcomm.py
from torch.utils.data import DataLoader

import autodist

RANKS = 3


def train(args: argparse.Namespace) -> None:
    """One rank of one run: ``args.run`` with ``--slow``, ``--kill`` and ``--workers`` as the launch set them."""
    train_set, test_set = digits()
    mode, slow, kill = args.run, args.slow, args.kill
    strategy = {"exact sync": "backward", "Downpour": autodist.Downpour(), "EASGD": autodist.EASGD()}[mode]
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, data = autodist.parallelize(mlp(), loader, sync=strategy)
    # Downpour applies every worker's gradient as a step of its own: P times the steps of exact sync per epoch
    lr = LR / autodist.world_size() if mode == "Downpour" else LR
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    rank = autodist.rank()
    start, reached, curve = time.perf_counter(), None, []
    for epoch in range(args.epochs if rank < args.workers else 0):
        for step, (x, y) in enumerate(data):
            if kill and rank == 2 and epoch == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.compute * (3 if slow and rank == 2 else 1))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if rank == 0:
            acc = accuracy(model, test_set)
            curve.append(acc)
            if reached is None and acc >= args.target:
                reached = time.perf_counter() - start
    seconds = time.perf_counter() - start
    if not isinstance(strategy, str):
        strategy.close()  # every survivor ends with the servers' final model
    if rank == 0:
        updates = getattr(strategy, "version", 0)
        with open(args.result, "w") as f:
            json.dump({"accuracy": accuracy(model, test_set), "seconds": seconds, "reached": reached,
                       "curve": curve, "updates": updates, "lost": sorted(getattr(strategy, "lost", {}))}, f)


def launch(parser: harness.Parser, args: argparse.Namespace, mode: str, **run: Any) -> dict:
    """One run of ``mode`` on RANKS ranks (``run``: options of that run over ``args``); rank 0's results."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = parser.forwarded(argparse.Namespace(**vars(args) | {"run": mode, "result": result} | run))
    codes = harness.mpirun(parser.script, RANKS, argv, env={"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"})
    if codes[0] != 0:
        raise SystemExit(f"{mode}: rank 0 exited with {codes[0]}")
    with open(result) as f:
        outcome = json.load(f)
    os.remove(result)
    return outcome | {"codes": codes}


def tables(parser: harness.Parser, args: argparse.Namespace) -> int:
    """Every run, one after the other, each on RANKS fresh processes; the tables as they come.

    ``--quick`` makes one run of each kind (a launch costs seconds of process start): exact sync, EASGD with
    the straggler, Downpour losing a worker, 2 of the 3 ranks pushing.
    """
    modes = ("exact sync", "Downpour", "EASGD")
    print(f"\n{RANKS} ranks, digits, {args.epochs} epochs, global batch {BATCH}, {args.compute * 1e3:.0f} ms "
          f"of compute per step, target {args.target:.0f}%\n")
    print("| run | final accuracy (%) | seconds to target | seconds | note |")
    print("|---|---|---|---|---|")

    def row(name: str, r: dict, note: str = "") -> None:
        reached = f"{r['reached']:.1f}" if r["reached"] is not None else "not reached"
        print(f"| {name} | {r['accuracy']:.1f} | {reached} | {r['seconds']:.1f} | {note} |", flush=True)

    for mode in ("exact sync",) if args.quick else modes:
        row(mode, launch(parser, args, mode))
    for mode in ("EASGD",) if args.quick else modes:
        row(f"{mode}, rank 2 3x slower", launch(parser, args, mode, slow=True))
    killed = launch(parser, args, "Downpour", kill=True)
    row("Downpour, rank 2 SIGKILLed in epoch 2", killed, f"exit codes {killed['codes']}, lost {killed['lost']}")
    print("\n| workers pushing | server updates | updates/s |\n|---|---|---|")
    for workers in (2,) if args.quick else range(1, RANKS + 1):
        r = launch(parser, args, "Downpour", workers=workers, epochs=args.push_epochs, compute=0.0)
        print(f"| {workers} | {r['updates']} | {r['updates'] / r['seconds']:.0f} |", flush=True)
    return 0


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=RANKS)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--compute", type=float, default=0.004, help="seconds each step sleeps (3x on the slow rank)")
    parser.add_argument("--target", type=float, default=95.0, help="test accuracy (%%) for time-to-target")
    parser.add_argument("--push-epochs", type=int, default=10, help="epochs of the server throughput runs")
    # one run, as the launch sets it for the workers
    parser.add_argument("--run", choices=["exact sync", "Downpour", "EASGD"], help=argparse.SUPPRESS)
    parser.add_argument("--slow", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=RANKS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    # --quick: 2 epochs (the lost worker dies in its second), one run of each kind (see tables)
    args = parser.parse(quick={"epochs": 2, "push_epochs": 1})
    return harness.run(parser, args, train, launch=tables)


if __name__ == "__main__":
    sys.exit(main())
