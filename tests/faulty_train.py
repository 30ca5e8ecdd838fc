"""A training script with one fault injected, run on real ranks by tests/faults/test_watchdog.py.

Usage: python faulty_train.py FAULT [checkpoint path]. Each fault happens on rank 1 at step 3
(unless it is about the data): "none", "sleep", "raise", "kill", "uneven_loader", "uneven_shards",
"save_on_rank0"; "evaluate": rank 0 evaluates alone at step 3 for EVALUATE_S seconds (nanoGPT's
estimate_loss on rank 0 only); "kill0": rank 0, which hosts the rendezvous store, SIGKILLs itself at step 3,
the parameters sharded (shard="parameters": rank 1 waits for it in an all-gather).
"""
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import autodist


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def estimate_loss(model: torch.nn.Module, seconds: float) -> float:
    """An evaluation on held-out data that lasts ``seconds``, as nanoGPT's estimate_loss runs on rank 0 only:
    forwards in eval mode without gradients (a forward of plain data parallelism talks to no other rank)."""
    x, y = _data(64)
    model.eval()
    losses, end = [], time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            losses.append(F.cross_entropy(model(x), y).item())
            time.sleep(0.02)
    model.train()
    return sum(losses) / len(losses)


def _inject(fault: str, rank: int, step: int, model: torch.nn.Module) -> None:
    if fault == "evaluate" and rank == 0 and step == 3:
        print(f"fault at {time.time():.3f}", flush=True)
        estimate_loss(model, float(os.environ["EVALUATE_S"]))
    if fault == "kill0" and rank == 0 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 1 or step != 3 or fault not in ("sleep", "raise", "kill"):
        return
    print(f"fault at {time.time():.3f}", flush=True)
    if fault == "sleep":
        time.sleep(1000)  # user code stuck (a deadlock, stuck I/O)
    if fault == "raise":
        raise ValueError("boom in rank 1's loss")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def main(fault: str, path: str | None) -> None:
    world = autodist.init()
    model = _model()
    if fault == "uneven_loader":  # every rank loads "its own" data: 320 vs 256 samples, 5 vs 4 global batches
        loader = DataLoader(TensorDataset(*_data(320 if world.rank == 0 else 256)), batch_size=64)
        model, loader = autodist.parallelize(model, loader)
        batches = loader
    elif fault == "uneven_shards":  # 101 samples in strided shards of 51 and 50, batches of 10: 6 vs 5 steps
        model, (x, y) = autodist.parallelize(model, _data(101))
        batches = [(x[i:i + 10], y[i:i + 10]) for i in range(0, len(x), 10)]
    else:
        model, loader = autodist.parallelize(model, DataLoader(TensorDataset(*_data(96)), batch_size=16),
                                             shard="parameters" if fault == "kill0" else None)
        batches = loader
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches, 1):
        _inject(fault, world.rank, step, model)
        _step(model, opt, x, y)
    print(f"loop done at {time.time():.3f}", flush=True)
    if fault == "save_on_rank0" and world.rank == 0:
        autodist.save(path, model, opt)  # a collective the other ranks never join
    print(f"rank {world.rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
