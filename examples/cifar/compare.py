"""Run the example four ways and compare: 1 process, 2 ranks dp, 2 ranks mp, 4 ranks dp2 x mp2.

    python examples/cifar/compare.py --epochs 10 --out examples/cifar/results

Writes ``results.md`` (a table like Horovod's: final train loss, test accuracy,
time per epoch) and ``results.png`` (loss and accuracy per epoch) into --out,
and each run's own ``metrics.json`` and ``metrics.png`` into a folder of its
own there. All four runs train the same model on the same global batches, so
their curves should lie on top of each other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import plots

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = [  # (label, ranks, mode)
    ("1 process", 1, "dp"),
    ("2 ranks, dp", 2, "dp"),
    ("2 ranks, mp", 2, "mp"),
    ("4 ranks, dp2 x mp2", 4, "hybrid"),
]


def run(label: str, ranks: int, mode: str, args: argparse.Namespace, out: str) -> dict:
    script = [os.path.join(HERE, "train.py"), "--mode", mode, "--model", args.model, "--epochs", str(args.epochs),
              "--batch-size", str(args.batch_size), "--data-dir", args.data_dir, "--out", out, "--no-progress"]
    if ranks == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "autodist", "run", "-n", str(ranks), *script]
    print(f"== {label}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def table(results: list[tuple[str, dict]]) -> str:
    """A markdown table of (label, metrics.json) pairs: final train loss, test accuracy, mean time per epoch.

    Example:
        >>> print(table([("1 process", json.load(open("results/1-dp/metrics.json")))]))
        Dataset: scikit-learn digits, model: mlp, 10 epochs, global batch 64, SGD + momentum.
        ...
    """
    first = results[0][1]
    lines = [f"Dataset: {first['dataset']}, model: {first['model']}, {len(first['history'])} epochs, "
             f"global batch {first['batch_size']}, SGD + momentum.", "",
             "| run | final train loss | test accuracy | time per epoch |", "|---|---|---|---|"]
    for label, r in results:
        last = r["history"][-1]
        per_epoch = sum(h["seconds"] for h in r["history"]) / len(r["history"])
        lines.append(f"| {label} | {last['train_loss']:.4f} | {last['test_accuracy']:.2f}% | {per_epoch:.2f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--model", choices=["mlp", "convnet"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch of every run")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    results = []
    for label, ranks, mode in RUNS:
        out = os.path.join(args.out, f"{ranks}-{mode}")
        results.append((label, run(label, ranks, mode, args, out)))
    text = table(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    plots.plot_runs(results, os.path.join(args.out, "results.png"))
    print(text)


if __name__ == "__main__":
    main()
