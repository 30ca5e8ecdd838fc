"""One cell of the fault matrix (tests/faults/test_fault_matrix.py): a sync mode, a fault, a checkpoint.

Usage: python matrix_train.py MODE FAULT CHECKPOINT, under a launcher on 2 ranks. MODE: backward (elastic: the
same under autodist run --elastic), manual,
localsgd, diloco, gossip, hierarchical, downpour, easgd, mp2, pp2, shard-optimizer, shard-gradients, shard-parameters
(and comm: no parallelize).
FAULT, on rank 1 at step 4: none (the script ends without any flush or close call), raise, kill (SIGKILL),
stall (sleeps); or on rank 0 at step 4: evaluate (rank 0 evaluates alone for 3 x AUTODIST_TIMEOUT, as
nanoGPT's estimate_loss does; at mp=2, pp=2 and shard="parameters", where a forward needs every rank, it computes
held-out statistics of its own instead). A checkpoint is written with autodist.save after step 2 (none at the end: saving would
settle what the end must settle by itself).
"""
import atexit
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import autodist

FAULT_STEP = 4
LEFT_RUNNING = "a thread of autodist's still runs after autodist's end"


def threads_left() -> None:
    """At exit, after autodist's end (registered before autodist's, so run after it): autodist's own threads must
    be gone. One still inside a store request when the interpreter finalizes aborts the process."""
    left = [t.name for t in threading.enumerate() if t.name.startswith("autodist-") and t.is_alive()]
    if left:
        print(f"{LEFT_RUNNING}: {', '.join(left)}", flush=True)


atexit.register(threads_left)


def strategy(mode: str) -> dict:
    return {
        "backward": lambda: {}, "elastic": lambda: {}, "manual": lambda: {"sync": "manual"}, "mp2": lambda: {"mp": 2}, "pp2": lambda: {"pp": 2},
        "localsgd": lambda: {"sync": autodist.LocalSGD(every=2)},
        "diloco": lambda: {"sync": autodist.DiLoCo(every=4, fragments=2, overlap=1)},  # streamed: averages in flight
        "gossip": lambda: {"sync": autodist.Gossip()},
        "hierarchical": lambda: {"sync": autodist.Hierarchical(ranks_per_host=1, across=autodist.LocalSGD(every=2))},
        "downpour": lambda: {"sync": autodist.Downpour()}, "easgd": lambda: {"sync": autodist.EASGD(every=2)},
        "shard-optimizer": lambda: {"shard": "optimizer"},
        "shard-gradients": lambda: {"shard": "gradients"}, "shard-parameters": lambda: {"shard": "parameters"},
    }[mode]()


def without_parallelize(fault: str) -> None:
    """Mode "comm": collectives of autodist.comm only (no watchdog); "stall" sleeps at the end of rank 1's script."""
    autodist.init()
    for _ in range(3):
        autodist.comm.all_reduce(torch.ones(2))
    print(f"rank {autodist.rank()} done at {time.time():.3f}", flush=True)
    if fault == "stall" and autodist.rank() == 1:
        time.sleep(1000)


def evaluate(model: torch.nn.Module, mode: str, seconds: float) -> None:
    """Rank 0 alone, ``seconds`` long: eval-mode forwards on held-out data without gradients where a forward
    talks to no other rank, else statistics of the held-out data (its own code all the same)."""
    held_out = torch.randn(64, 6, generator=torch.Generator().manual_seed(2))
    model.eval()
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            (held_out.std(0) if mode in ("mp2", "pp2", "shard-parameters") else model(held_out)).sum().item()
            time.sleep(0.02)
    model.train()


def main(mode: str, fault: str, path: str) -> None:
    if mode == "comm":
        return without_parallelize(fault)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 4, (96,), generator=g))
    model, loader = autodist.parallelize(model, DataLoader(data, batch_size=16), **strategy(mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # state to shard and to checkpoint
    for step, (x, y) in enumerate(loader, 1):
        if autodist.rank() == 0 and step == FAULT_STEP and fault == "evaluate":
            print(f"fault at {time.time():.3f}", flush=True)
            evaluate(model, mode, 3 * float(os.environ["AUTODIST_TIMEOUT"]))
        if autodist.rank() == 1 and step == FAULT_STEP and fault not in ("none", "evaluate"):
            print(f"fault at {time.time():.3f}", flush=True)
            if fault == "raise":
                raise ValueError("boom in rank 1's loss")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1000)  # "stall": user code stuck (a deadlock, stuck I/O)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if mode == "manual":
            autodist.synchronize_model(model)
        opt.step()
        if step == 2:
            autodist.save(path, model, opt, step=step)
    print(f"rank {autodist.rank()} done at {time.time():.3f}", flush=True)  # no flush(), no close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
