"""A training script for jobs across the two hosts of tests/cluster.py (run by tests/e2e/test_two_hosts.py).

Usage: python two_hosts_train.py OUT [--mp K] [--epochs E] [--step-sleep S] [--hierarchical H]

Trains a small Linear/Tanh stack with Adam, data parallel over the ranks (and
model parallel in groups of K ranks with ``--mp K``), and on rank 0 saves the
dense final state with where every rank ran: its network namespace (the
inode of /proc/self/ns/net: one per host) and torchrun's node rank. With
``--step-sleep`` each step sleeps that long and rank 0 prints ``step N``, so
that a test can kill a host mid-run. With ``--hierarchical H`` it then trains
a wider model with ``autodist.Hierarchical(across=autodist.LocalSGD(every=H))``
and saves, per rank, its parameters, the bytes it says it sent to the other
host, and the bytes its host's end of the link really sent meanwhile.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autodist
import workloads as w


def build() -> nn.Module:
    # widths 20 and 16: the Linears split by mp=2 into pairs (column then row)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 20), nn.Tanh(),
                         nn.Linear(20, 3))


def data() -> torch.utils.data.DataLoader:
    x, y = w.digits_like(30, features=12)
    return w.loader(x, y, 8)


def train(model: nn.Module, loader, epochs: int, step_sleep: float = 0.0, log: bool = False) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if log:
                print(f"step {step}", flush=True)
            time.sleep(step_sleep)
    return model


def link_bytes() -> int:
    """Bytes this host's end of the link sent so far (traffic between ranks of one host never uses it)."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def hierarchical(every: int, steps: int) -> dict:
    """Train ``steps`` steps with exact sync inside each host and local SGD between the hosts."""
    size = dist.get_world_size()
    x, y = w.digits_like(steps * 4 * size, features=12)
    sync = autodist.Hierarchical(across=autodist.LocalSGD(every=every))
    wide = nn.Sequential(nn.Linear(12, 512), nn.Tanh(), nn.Linear(512, 3))  # 8,195 parameters: 32 KB
    model, loader = autodist.parallelize(wide, w.loader(x, y, 4 * size), sync=sync)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()
    before = link_bytes()
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    dist.barrier()
    return {"link": link_bytes() - before, "across": sync.bytes_across_hosts, "syncs": sync.syncs,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def reference(epochs: int) -> dict[str, torch.Tensor]:
    """The single-process run the parallel one must equal."""
    return w.state(train(w.seeded(build, 0), data(), epochs))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mp", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--hierarchical", type=int, default=0, metavar="H", help="then Hierarchical(LocalSGD(H))")
    args = parser.parse_args()
    world = autodist.init()
    where = (world.rank, os.stat("/proc/self/ns/net").st_ino, int(os.environ.get("GROUP_RANK", -1)))
    ranks: list = [None] * world.size
    dist.all_gather_object(ranks, where)
    model, loader = autodist.parallelize(w.seeded(build, 0 if world.rank == 0 else 7 + world.rank), data(), mp=args.mp)
    train(model, loader, args.epochs, args.step_sleep, log=world.rank == 0 and args.step_sleep > 0)
    state = autodist.gather_state_dict(model)
    saved = {"state": state, "world": world.size, "ranks": ranks}
    if args.hierarchical:
        per_rank: list = [None] * world.size
        dist.all_gather_object(per_rank, hierarchical(args.hierarchical, steps=4 * args.hierarchical))
        saved["hierarchical"] = per_rank
    if world.rank == 0:
        torch.save(saved, args.out)


if __name__ == "__main__":
    main()
