"""A float64 run from a stream, 2 micro-batches accumulated under ``no_sync``, its loss a mean over the labels
that are not ignored (-1): run by tests/faults/test_elastic.py under ``autodist run --elastic``.

Usage: python elastic_stream_train.py OUT KILL [CHANGING]. KILL is "" or RANK:ITERATION: that rank SIGKILLs itself
in the backward of its loop's ITERATION-th micro-batch (counted from 0 over the run; an even one is inside
``no_sync``, where the ranks sum only the micro-batch's count of labels). With CHANGING the stream gives other
batches each time it is iterated after the first. Rank 0 writes OUT: the parameters and the loop's iterations.
Run in one process (no launcher) it is the reference.
"""
import contextlib
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import autodist

torch.set_default_dtype(torch.float64)
SAMPLES, BATCH, ACCUMULATE, EPOCHS = 90, 12, 2, 2  # 8 batches an epoch, the last of 6


class Stream(IterableDataset):
    def __init__(self, changing: bool) -> None:
        self.changing, self.reads = changing, 0

    def __iter__(self):
        self.reads += 1
        g = torch.Generator().manual_seed(1 + (self.reads if self.changing and self.reads > 1 else 0))
        for _ in range(SAMPLES):
            yield torch.randn(5, generator=g), int(torch.randint(-1, 3, (), generator=g))


def main(out: str, kill: str, changing: bool) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net, data = autodist.parallelize(net, DataLoader(Stream(changing), batch_size=BATCH))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    rank, when = (int(k) for k in kill.split(":")) if kill else (-1, -1)
    iterations = 0
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(data):
            last = i % ACCUMULATE == ACCUMULATE - 1
            with contextlib.nullcontext() if last else autodist.no_sync(net):
                if (iterations, autodist.rank()) == (when, rank) and not os.environ.get("AUTODIST_ELASTIC_JOIN"):
                    net[0].bias.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
                (F.cross_entropy(net(x), y, ignore_index=-1) / ACCUMULATE).backward()
            iterations += 1
            if last:
                opt.step()
                opt.zero_grad()
    if autodist.rank() == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in net.state_dict().items()},
                    "iterations": iterations}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3)
