"""Data-parallel training of an MLP on scikit-learn's digits (real 8x8 images shipped inside the package).

Run it on 2 processes:   autodist run -n 2 examples/digits_dp.py --epochs 10
or alone:                python examples/digits_dp.py

The distributed part is the single `autodist.parallelize` line: the rest is an
ordinary single-process PyTorch script, and it trains the same model either way.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """1797 digits, scaled to [0, 1]; a fixed 80/20 train/test split."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return 100.0 * correct / len(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train_set, test_set = digits(args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))

    model, loader = autodist.parallelize(model, loader)

    world = autodist.init()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if world.is_main:
        print(f"dataset: scikit-learn digits ({len(train_set)} train / {len(test_set)} test images), "
              f"{world.size} rank(s), global batch {args.batch_size}", flush=True)
    for epoch in range(1, args.epochs + 1):
        start, total, seen = time.perf_counter(), 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
        if world.is_main:  # every rank holds the same model, so rank 0 can evaluate alone
            print(f"epoch {epoch:3d}  rank-0 train loss {total / max(seen, 1):.4f}  "
                  f"test accuracy {accuracy(model, test_set):5.1f}%  {time.perf_counter() - start:.2f}s", flush=True)


if __name__ == "__main__":
    main()
