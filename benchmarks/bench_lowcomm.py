"""Low-communication modes against exact sync and torch's PostLocalSGDOptimizer on one task.

What it measures
    Two ranks (torchrun, gloo, CPU) train the same MLP 64-128-128-10 on
    scikit-learn's digits (1,437 train / 360 test images, standardized), global
    batch 32, SGD lr 0.05 momentum 0.9, ``--epochs`` epochs, once per mode:
    exact sync (autodist's default), ``autodist.LocalSGD(every=16)``,
    ``autodist.DiLoCo(every=16)`` and ``autodist.DiLoCo()`` (every=64), and
    torch's ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager(period=16)``
    over autodist's sharded loader (``sync="manual"``, never synchronized
    otherwise). Then the same over an inner AdamW (lr 3e-3, next to exact sync
    with the same AdamW), as DiLoCo's paper runs it, and streamed in 4
    fragments whose all-reduce runs one step behind. DiLoCo's outer step is
    its default, outer_lr 0.5 and momentum 0.5 (chosen at the first step;
    the same over SGD and AdamW); two rows show the paper's 0.7 and 0.9
    instead, over SGD and over AdamW. Every mode ends with one model
    (local modes: a final parameter average, counted) evaluated on the test
    set.

How to run
    python benchmarks/bench_lowcomm.py              # about a minute on 2 cores
    python benchmarks/bench_lowcomm.py --epochs 3   # fewer epochs
    python benchmarks/bench_lowcomm.py --seed 1     # other initial weights and data order
    python benchmarks/bench_lowcomm.py --quick      # smoke run of seconds (1 epoch)

How to read it
    accuracy: test accuracy of the final model (%). MB/rank: megabytes each
    rank sent, as ring all-reduce volume 2(P-1)/P x tensor bytes: autodist's
    modes report it (``strategy.bytes_sent``); for exact sync and torch's
    averager it is computed from what they all-reduce (every gradient every
    step; the parameters every period). seconds: wall time of the training
    loop on rank 0. Timings on a shared 2-core machine with a loopback link:
    the point of these modes is a slow link, which this run does not have.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.comm import ring_bytes

BATCH, LR, MOMENTUM, PERIOD = 32, 0.05, 0.9, 16
ADAMW_LR = 3e-3


def digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(model: nn.Module, test: TensorDataset) -> float:
    with torch.no_grad():
        x, y = test.tensors
        return 100.0 * float((model(x).argmax(1) == y).float().mean())


MODES = ("exact sync", "LocalSGD(every=16)", "DiLoCo(every=16)", "DiLoCo(every=64)", "torch PostLocalSGD(16)")
# DiLoCo over the paper's inner AdamW, streamed; then the paper's outer step over SGD and over AdamW
ADAMW_MODES = ("exact sync, AdamW", "DiLoCo(every=16), AdamW", "DiLoCo(every=64), AdamW",
               "DiLoCo(every=16, fragments=4, overlap=1), AdamW", "DiLoCo(every=16, outer_lr=0.7, momentum=0.9)",
               "DiLoCo(every=64, outer_lr=0.7, momentum=0.9), AdamW")


def strategy_for(mode: str) -> Any:
    """The ``sync=`` argument of ``mode`` (one of MODES or ADAMW_MODES)."""
    name = mode.split(", AdamW")[0]
    if name in ("exact sync", "torch PostLocalSGD(16)"):
        return "backward" if name == "exact sync" else "manual"
    if name == "LocalSGD(every=16)":
        return autodist.LocalSGD(every=PERIOD)
    if name == "DiLoCo(every=64)":
        return autodist.DiLoCo()  # every argument defaulted
    if not name.startswith("DiLoCo(") or not name.endswith(")"):
        raise ValueError(f"unknown mode {mode!r}")
    options = dict(option.split("=") for option in name[len("DiLoCo("):-1].split(", "))
    return autodist.DiLoCo(**{k: int(v) if k in ("every", "fragments", "overlap") else float(v)
                              for k, v in options.items()})

# Called after every training step with (steps done, model, seconds on the clock, bytes sent so far); returns
# the seconds it spent, which are taken off the clock (an evaluation, say).
Probe = Callable[[int, nn.Module, float, float], float]


def sent_so_far(mode: str, strategy: Any, params: list[torch.Tensor], steps: int, size: int) -> float:
    """Bytes this rank sent in the first ``steps`` steps (ring all-reduce volume), before any final average."""
    if mode.startswith("exact sync"):
        return steps * ring_bytes(params, size)  # every gradient, every step
    if not isinstance(strategy, str):
        return strategy.bytes_sent  # autodist's modes count their own traffic
    averages = sum(1 for s in range(steps) if s % PERIOD == 0)  # torch's averager: at steps 0, 16, ...
    return averages * ring_bytes(params, size)


def run(mode: str, train: TensorDataset, test: TensorDataset, epochs: int,
        probe: Probe | None = None, seed: int = 0) -> tuple[float, float, float]:
    """Train with ``mode`` (one of MODES) from initial weights ``seed`` and the data shuffled by ``seed + 1``;
    test accuracy (%), MB this rank sent, seconds of training."""
    size = autodist.init().size
    strategy = strategy_for(mode)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed + 1))
    model, data = autodist.parallelize(mlp(seed), loader, sync=strategy)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if mode.endswith(", AdamW"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    if mode.startswith("torch"):
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=PERIOD, warmup_steps=0))
    params = list(model.parameters())
    steps, off_clock = 0, 0.0
    start = time.perf_counter()
    for _ in range(epochs):
        for x, y in data:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
            if probe is not None:
                on_clock = time.perf_counter() - start - off_clock
                off_clock += probe(steps, model, on_clock, sent_so_far(mode, strategy, params, steps, size))
    sent = sent_so_far(mode, strategy, params, steps, size)
    if not mode.startswith("exact sync"):
        autodist.synchronize_model(model, what="parameters")  # end with one model
        sent += ring_bytes(params + [b for b in model.buffers() if b.is_floating_point()], size)
    seconds = time.perf_counter() - start - off_clock
    return accuracy(model, test), sent / 1e6, seconds


def print_table(title: str, metric: str, rows: list[tuple[str, str, float, float]]) -> None:
    """On rank 0: one markdown row per (mode, metric as printed, MB sent, seconds); the first row is exact sync."""
    if autodist.init().rank != 0:
        return
    exact_mb = rows[0][2]  # exact sync sends the same bytes whatever its optimizer
    print(f"\n{autodist.init().size} ranks, {title}\n")
    print(f"| mode | {metric} | MB sent / rank | less traffic than exact | seconds |")
    print("|---|---|---|---|---|")
    for mode, value, mb, seconds in rows:
        print(f"| {mode} | {value} | {mb:.2f} | {exact_mb / mb:.0f}x | {seconds:.1f} |")


def worker(args: argparse.Namespace) -> None:
    train, test = digits()
    rows = []
    for mode in MODES + ADAMW_MODES:
        acc, mb, seconds = run(mode, train, test, args.epochs, seed=args.seed)
        rows.append((mode, f"{acc:.1f}", mb, seconds))
    print_table(f"digits, {args.epochs} epochs, global batch {BATCH}, seed {args.seed}", "accuracy (%)", rows)


ENV = {"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"}  # for the ranks: one thread, no summary lines


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights; the data order is seed + 1 (default 0)")
    args = parser.parse(quick={"epochs": 1})
    return harness.run(parser, args, worker, env=ENV)


if __name__ == "__main__":
    sys.exit(main())
