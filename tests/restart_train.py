"""A training script that resumes from its checkpoint, run by tests/train/test_restart.py under `autodist run --max-restarts`.

usage: restart_train.py CHECKPOINT OUT [KILL_MARKER]

Trains the MLP of workloads.py for a few epochs on a loader that shuffles with
the global RNG, saving a checkpoint after every epoch. With KILL_MARKER, rank 1
SIGKILLs itself in the middle of epoch 2 unless the marker file exists (it
writes the marker, holding the time, first): the first attempt dies, the
restarted one resumes. Rank 0 saves the final state dict, the epoch it resumed
from, the restart count and the seconds from the kill to the resumed training.
RESTART_LAYOUT=shard-optimizer parallelizes with shard="optimizer" (tests/faults/test_elastic.py: a layout
that cannot go on without a lost rank, under autodist run --elastic).
"""
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import autodist
import workloads as w

EPOCHS, KILL_EPOCH, KILL_STEP = 4, 2, 2


def _maybe_die(marker: str | None, rank: int, epoch: int, step: int) -> None:
    if marker is None or rank != 1 or (epoch, step) != (KILL_EPOCH, KILL_STEP):
        return
    try:
        with open(marker, "x") as f:  # only the first attempt gets here without it
            f.write(repr(time.time()))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def main(checkpoint: str, out: str, marker: str | None) -> None:
    world = autodist.init()
    torch.manual_seed(0)
    x, y = w.digits_like(48)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # the global RNG: load restores it
    layout = {"shard": "optimizer"} if os.environ.get("RESTART_LAYOUT") == "shard-optimizer" else {}
    model, data = autodist.parallelize(w.mlp(), loader, **layout)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    start = autodist.resume(checkpoint, model, optimizer, epoch=0)["epoch"]
    resumed_at = time.time()
    for epoch in range(start, EPOCHS):
        for step, (xb, yb) in enumerate(data):
            _maybe_die(marker, world.rank, epoch, step)
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        autodist.save(checkpoint, model, optimizer, epoch=epoch + 1)

    if world.rank == 0:
        killed_at = float(open(marker).read()) if marker and os.path.exists(marker) else None
        torch.save({"state": w.state(model), "resumed_from": start,
                    "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "restart_s": None if killed_at is None or start == 0 else resumed_at - killed_at}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
