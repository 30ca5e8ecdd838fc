"""Low-communication modes on a small language model: exact sync, LocalSGD, DiLoCo, torch's local SGD.

What it measures
    Two ranks (torchrun, gloo, CPU) train a character-level language model
    (embedding 32, a 2-layer GRU of width 128, a linear head) on the source
    text of Python's own ``argparse`` module (shipped with every Python: no
    download), windows of 64 characters, global batch 32, AdamW lr 3e-3,
    ``--epochs`` passes, once per mode: exact sync (autodist's default),
    ``autodist.LocalSGD(every=16)``, ``autodist.DiLoCo(every=16)`` over the
    AdamW (the paper's setting), streamed in 4 fragments, and torch's
    ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=16)``. Each
    ends with one model (local modes: a final average, counted), evaluated on
    the last 10% of the text: loss in nats per character (lower is better).
    The modes' traffic is counted as in ``bench_lowcomm.py``.

How to run
    python benchmarks/bench_lowcomm_lm.py              # about 90 s on 2 cores
    python benchmarks/bench_lowcomm_lm.py --epochs 1   # fewer epochs
    python benchmarks/bench_lowcomm_lm.py --quick      # smoke run of seconds (1 epoch of 512 windows)
"""
from __future__ import annotations

import argparse  # its source is also the text the model learns
import inspect
import sys
import time

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.nn.functional as F
from bench_lowcomm import ADAMW_LR, BATCH, ENV, PERIOD, print_table, sent_so_far, strategy_for
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.comm import ring_bytes

WINDOW = 64
MODES = ("exact sync, AdamW", "LocalSGD(every=16), AdamW", "DiLoCo(every=16), AdamW",
         "DiLoCo(every=16, fragments=4, overlap=1), AdamW", "torch PostLocalSGD(16), AdamW")


def text_windows() -> tuple[TensorDataset, torch.Tensor, int]:
    """(train windows of WINDOW + 1 characters, held-out text, vocabulary size) from argparse's source."""
    text = inspect.getsource(argparse).encode("ascii", "replace")
    codes = torch.tensor(list(text), dtype=torch.long)
    vocab = int(codes.max()) + 1
    split = int(0.9 * len(codes))
    starts = torch.arange(0, split - WINDOW - 1, WINDOW)
    windows = torch.stack([codes[s:s + WINDOW + 1] for s in starts.tolist()])
    return TensorDataset(windows), codes[split:], vocab


class CharLM(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.rnn = nn.Embedding(vocab, 32), nn.GRU(32, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def loss_of(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def held_out_loss(model: nn.Module, text: torch.Tensor) -> float:
    n = (len(text) - 1) // WINDOW * WINDOW
    windows = torch.stack([text[s:s + WINDOW + 1] for s in range(0, n - WINDOW, WINDOW)])
    with torch.no_grad():
        return float(loss_of(model, windows))


def run(mode: str, train: TensorDataset, test: torch.Tensor, vocab: int, epochs: int) -> tuple[float, float, float]:
    """Train with ``mode``; held-out loss (nats/char), MB this rank sent, seconds of training."""
    size = autodist.init().size
    strategy = strategy_for(mode)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, data = autodist.parallelize(CharLM(vocab), loader, sync=strategy)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    if mode.startswith("torch"):
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=PERIOD, warmup_steps=0))
    params, steps, start = list(model.parameters()), 0, time.perf_counter()
    for _ in range(epochs):
        for (windows,) in data:
            optimizer.zero_grad()
            loss_of(model, windows).backward()
            optimizer.step()
            steps += 1
    sent = sent_so_far(mode, strategy, params, steps, size)
    if not mode.startswith("exact sync"):
        autodist.synchronize_model(model, what="parameters")  # end with one model
        sent += ring_bytes(params, size)
    return held_out_loss(model, test), sent / 1e6, time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    train, test, vocab = text_windows()
    if args.windows:
        train = TensorDataset(train.tensors[0][:args.windows])
    rows = []
    for mode in MODES:
        loss, mb, seconds = run(mode, train, test, vocab, args.epochs)
        rows.append((mode, f"{loss:.3f}", mb, seconds))
    print_table(f"char LM on argparse's source ({len(train)} windows of {WINDOW}), {args.epochs} epochs, global batch "
                f"{BATCH}, AdamW", "held-out loss (nats/char)", rows)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.add_argument("--epochs", type=int, default=8, help="passes over the training windows (default 8)")
    parser.add_argument("--windows", type=int, default=0, help="train on the first N windows only (default 0: all)")
    args = parser.parse(quick={"epochs": 1, "windows": 512})
    return harness.run(parser, args, worker, env=ENV)


if __name__ == "__main__":
    sys.exit(main())
