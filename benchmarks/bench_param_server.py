"""Parameter-server training (Downpour, EASGD) against exact sync on digits: accuracy, stragglers, a lost worker.

What it measures
    Three CPU ranks train bench_lowcomm's MLP 64-128-128-10 on scikit-learn's digits (its ``digits()``,
    ``mlp()`` and ``accuracy()``), global batch 32, SGD lr 0.05 momentum 0.9 (Downpour: lr 0.05 / 3, as
    every worker's gradient is a step of its own). Every step also sleeps ``--compute`` seconds (a stand-in for a real model's compute, so that one rank can be made slower):

    * accuracy at the same samples: ``--epochs`` epochs of exact sync, ``Downpour()`` and ``EASGD()``;
    * a straggler: rank 2 sleeps 3x as long per step; seconds until rank 0's model (after each of its
      passes: the exact model, or the servers' parameters) first reaches ``--target`` test accuracy;
    * a lost worker: rank 2 SIGKILLs itself in its second epoch; the others go on (Downpour);
    * server throughput: updates per second the server (rank 0) applies as 1, 2, 3 workers push
      (no sleep), the others only waiting.

    The ranks are started as ``mpirun`` would start them (Open MPI environment, rendezvous on a free port),
    not through ``autodist run``: torchrun stops every rank when one dies.

How to run
    python benchmarks/bench_param_server.py            # about two minutes on 2 cores
    python benchmarks/bench_param_server.py --epochs 4 # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autodist
from bench_lowcomm import BATCH, LR, MOMENTUM, accuracy, digits, mlp  # benchmarks/, next to this file

RANKS = 3


def train(mode: str, epochs: int, compute: float, slow: bool, kill: bool, workers: int, target: float,
          out: str) -> None:
    torch.set_num_threads(1)
    train_set, test_set = digits()
    strategy = {"exact sync": "backward", "Downpour": autodist.Downpour(), "EASGD": autodist.EASGD()}[mode]
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, data = autodist.parallelize(mlp(), loader, sync=strategy)
    # Downpour applies every worker's gradient as a step of its own: P times the steps of exact sync per epoch
    lr = LR / autodist.world_size() if mode == "Downpour" else LR
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    rank = autodist.rank()
    start, reached, curve = time.perf_counter(), None, []
    for epoch in range(epochs if rank < workers else 0):
        for step, (x, y) in enumerate(data):
            if kill and rank == 2 and epoch == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(compute * (3 if slow and rank == 2 else 1))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if rank == 0:
            acc = accuracy(model, test_set)
            curve.append(acc)
            if reached is None and acc >= target:
                reached = time.perf_counter() - start
    seconds = time.perf_counter() - start
    if not isinstance(strategy, str):
        strategy.close()  # every survivor ends with the servers' final model
    if rank == 0:
        updates = getattr(strategy, "version", 0)
        with open(out, "w") as f:
            json.dump({"accuracy": accuracy(model, test_set), "seconds": seconds, "reached": reached,
                       "curve": curve, "updates": updates, "lost": sorted(getattr(strategy, "lost", {}))}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, args: argparse.Namespace, *, slow: bool = False, kill: bool = False,
           workers: int = RANKS, epochs: int | None = None, compute: float | None = None) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    env |= {"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING", "MASTER_PORT": str(_free_port())}
    argv = [sys.executable, __file__, "--worker", mode, str(args.epochs if epochs is None else epochs),
            str(args.compute if compute is None else compute), str(int(slow)), str(int(kill)), str(workers),
            str(args.target), out]
    procs = [subprocess.Popen(argv, env=env | {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(RANKS),
                                                "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                                                "OMPI_COMM_WORLD_LOCAL_SIZE": str(RANKS)})
             for r in range(RANKS)]
    codes = [p.wait(timeout=600) for p in procs]
    if codes[0] != 0:
        raise SystemExit(f"{mode}: rank 0 exited with {codes[0]}")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result | {"codes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--compute", type=float, default=0.004, help="seconds each step sleeps (3x on the slow rank)")
    parser.add_argument("--target", type=float, default=95.0, help="test accuracy (%%) for time-to-target")
    parser.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, epochs, compute, slow, kill, workers, target, out = args.worker
        train(mode, int(epochs), float(compute), slow == "1", kill == "1", int(workers), float(target), out)
        return
    print(f"\n{RANKS} ranks, digits, {args.epochs} epochs, global batch {BATCH}, {args.compute * 1e3:.0f} ms "
          f"of compute per step, target {args.target:.0f}%\n")
    print("| run | final accuracy (%) | seconds to target | seconds | note |")
    print("|---|---|---|---|---|")

    def row(name: str, r: dict, note: str = "") -> None:
        reached = f"{r['reached']:.1f}" if r["reached"] is not None else "not reached"
        print(f"| {name} | {r['accuracy']:.1f} | {reached} | {r['seconds']:.1f} | {note} |", flush=True)

    for mode in ("exact sync", "Downpour", "EASGD"):
        row(mode, launch(mode, args))
    for mode in ("exact sync", "Downpour", "EASGD"):
        row(f"{mode}, rank 2 3x slower", launch(mode, args, slow=True))
    killed = launch("Downpour", args, kill=True)
    row("Downpour, rank 2 SIGKILLed in epoch 2", killed, f"exit codes {killed['codes']}, lost {killed['lost']}")
    print("\n| workers pushing | server updates | updates/s |\n|---|---|---|")
    for workers in (1, 2, 3):
        r = launch("Downpour", args, workers=workers, epochs=10, compute=0.0)
        print(f"| {workers} | {r['updates']} | {r['updates'] / r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
