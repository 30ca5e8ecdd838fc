"""A complete training script, run by the launch tests on real launchers.

Trains the MLP of workloads.py on a DataLoader and, on rank 0, saves the final
state dict to the path given as the first argument.
"""
import sys

import torch

import autodist
import workloads as w


def main(out_path: str) -> None:
    world = autodist.init()
    torch.manual_seed(0 if world.rank == 0 else 1 + world.rank)
    x, y = w.digits_like(22)
    model, data = autodist.parallelize(w.mlp(), w.loader(x, y, 8))
    w.train(model, data, "adam", 3)
    if world.rank == 0:
        torch.save({"state": w.state(model), "world": world.size, "launcher": world.launcher}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
