"""Train on CIFAR-10 (or scikit-learn's digits when CIFAR-10 is absent), data or model parallel.

    python examples/cifar/train.py                                  # one process
    autodist run -n 2 examples/cifar/train.py --mode dp             # 2 ranks, data parallel
    autodist run -n 2 examples/cifar/train.py --mode mp             # 2 ranks, Linear layers split
    autodist run -n 4 examples/cifar/train.py --mode hybrid         # 2 data-parallel x 2 model-parallel
    autodist run -n 2 examples/cifar/train.py --sync local-sgd      # replicas average every 16 steps

The distributed part is the one `autodist.parallelize` line; everything else is
an ordinary single-process training script, and all modes train the same model
on the same global batches (``--sync local-sgd`` / ``diloco`` trade that for 16x less traffic).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autodist
from autodist import engine

import data as datasets
import models
import plots


# the sync= of parallelize for each --sync (a new strategy object per run)
SYNCS = {"exact": lambda: "backward", "local-sgd": lambda: autodist.LocalSGD(every=16),
         "diloco": lambda: autodist.DiLoCo(every=16)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["dp", "mp", "hybrid"], default="dp",
                   help="dp: data parallel; mp: every rank splits the Linear layers; hybrid: groups of 2 split them")
    p.add_argument("--sync", choices=list(SYNCS), default="exact",
                   help="exact: the same training as one process; local-sgd: LocalSGD(every=16), replicas step alone "
                        "and average every 16 steps; diloco: DiLoCo(every=16) over the SGD below")
    p.add_argument("--model", choices=["mlp", "convnet"], default="mlp")
    p.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py")
    p.add_argument("--download", action="store_true",
                   help="fetch CIFAR-10 (MD5-checked) if it is absent; one rank per machine fetches, the others wait")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the data-parallel ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for metrics.json and its plot, metrics.png (rank 0)")
    p.add_argument("--checkpoint", default=None, help="save here after every epoch, resume from it if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = autodist.init()
    if args.mode == "hybrid" and (world.size < 4 or world.size % 2):
        # on 2 ranks "hybrid" would be 1 data-parallel x 2 model-parallel: --mode mp under another name
        raise SystemExit(f"train.py: --mode hybrid needs an even number of ranks, 4 or more (groups of 2 split "
                         f"the Linear layers, and at least 2 groups train data parallel); this run has "
                         f"{world.size}: start it with -n 4 (bash scripts/main.sh -n 4 --mode hybrid), or use "
                         f"--mode mp")
    log = engine.rank_logger()
    torch.manual_seed(args.seed)
    data = datasets.load(args.data_dir, download=args.download, seed=args.seed)
    if world.is_main:
        log.info("dataset: %s (%d train / %d test images of %s)%s", data.name, len(data.train), len(data.test),
                 "x".join(map(str, data.image_shape)),
                 "" if data.name == "CIFAR-10" else f"; CIFAR-10 not found in {args.data_dir!r}")
    model = models.build(args.model, data.image_shape, data.classes).to(world.device)  # the GPU, if any
    shuffle = torch.Generator().manual_seed(args.seed)  # its state is saved with checkpoints
    loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=True, generator=shuffle)
    mp = {"dp": 1, "mp": world.size, "hybrid": 2}[args.mode]

    model, loader = autodist.parallelize(model, loader, mp=mp, sync=SYNCS[args.sync]())

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch, history = 1, []
    if args.checkpoint and os.path.isfile(args.checkpoint):
        extra = autodist.load(args.checkpoint, model, optimizer)
        first_epoch, history = extra["epoch"] + 1, extra["history"]
        shuffle.set_state(extra["shuffle_state"])
        log.info("resumed from %s after epoch %d", args.checkpoint, extra["epoch"])
    for epoch in range(first_epoch, args.epochs + 1):
        start, metrics = time.perf_counter(), engine.Metrics()
        model.train()
        batches = engine.prefetch(loader, device=world.device)  # moved to the model's device in the background
        for x, y in engine.progress(batches, total=len(loader), desc=f"epoch {epoch}", disable=args.no_progress):
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            metrics.update(loss.detach() * len(y), (out.argmax(1) == y).sum(), len(y))
        train, seconds = metrics.reduce(model), time.perf_counter() - start  # with the replicas' spread, if any
        if args.sync != "exact":  # the replicas differ between averages: evaluate (and save) their average
            autodist.synchronize_model(model, what="parameters")
        test = engine.evaluate(model, data.test)
        engine.log_epoch(epoch, train, test, seconds)
        history.append({"epoch": epoch, "train_loss": train["loss"], "train_accuracy": train["accuracy"],
                        "test_loss": test["loss"], "test_accuracy": test["accuracy"], "seconds": seconds})
        if args.checkpoint:
            autodist.save(args.checkpoint, model, optimizer, epoch=epoch, history=history,
                          shuffle_state=shuffle.get_state())
    if world.is_main and history:
        last = history[-1]
        log.info("final test accuracy %.2f%% (train loss %.4f) on %s, %d rank(s), mode %s, model %s%s",
                 last["test_accuracy"], last["train_loss"], data.name, world.size, args.mode, args.model,
                 "" if args.sync == "exact" else f", sync {args.sync}")
    if world.is_main and args.out:
        os.makedirs(args.out, exist_ok=True)
        summary = {"dataset": data.name, "mode": args.mode, "sync": args.sync, "model": args.model, "ranks": world.size, "mp": mp,
                   "batch_size": args.batch_size, "lr": args.lr, "history": history}
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(summary, f, indent=1)
        plots.plot_run(summary, os.path.join(args.out, "metrics.png"), log)


if __name__ == "__main__":
    main()
