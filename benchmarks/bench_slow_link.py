"""Time to accuracy over a slow link: exact sync against the low-communication modes on two hosts.

What it measures
    The training of ``bench_lowcomm.py`` (digits, MLP 64-128-128-10, global
    batch 32, SGD lr 0.05 momentum 0.9 or AdamW lr 3e-3; the same modes, one
    after another in one job), run by ``autodist run --nnodes 2`` on the two hosts of
    ``tests/cluster.py``: two network namespaces on this machine joined by a
    veth pair, one rank on each, the link rate-limited both ways with a token
    bucket (``tc ... tbf``, ``--rate``, 100 Mbit/s by default; ``--rate none``
    leaves it at memory speed). Every ``--eval-every`` steps the clock stops,
    the replicas' parameters are averaged (the model the job would end with if
    it stopped here) and evaluated on the test set; that averaging is neither
    timed nor counted.

How to run (root, with iproute2: it makes the namespaces)
    python benchmarks/bench_slow_link.py --out slow_link        # 5 seeds, about 15 minutes
    python benchmarks/bench_slow_link.py --epochs 3 --seeds 1 --out /tmp/s  # a short run
    python benchmarks/bench_slow_link.py --quick --out /tmp/s  # smoke run: 1 epoch, 1 seed, to a temporary folder
    python benchmarks/bench_slow_link.py --seeds 20 --mode "exact sync" --mode "LocalSGD(every=16)" \\
        --mode "torch PostLocalSGD(16)" --out slow_link_20   # three modes, 20 seeds

How to read it
    accuracy: test accuracy of the final model (%). MB / rank: what autodist
    counts (ring all-reduce volume, as bench_lowcomm.py), and what the host's
    end of the link really sent (``tx_bytes`` of its interface: TCP/IP headers,
    the rendezvous store's traffic and the model broadcast at the start
    included, the evaluations' averaging left out). steps / seconds to target:
    training steps and time until the averaged model first reached ``--target``
    % (checked every ``--eval-every`` steps; on 360 test images one image is
    0.28 points, so near the target one run's step count is partly luck:
    hence ``--seeds``, runs from other initial weights and data orders, and
    the table's medians over them, each seed's steps beside). seconds:
    the whole training loop. ``--out DIR``
    gets ``slow_link.json`` (every evaluation) and ``slow_link.png``: accuracy
    against seconds and against MB sent (the mean over the seeds), one line per
    mode, a row of plots per inner optimizer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import bench_lowcomm as lowcomm  # next to this file: the task, the modes and the training loop
import harness  # benchmarks/harness.py
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import autodist

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
PORT = 29400  # the cluster's namespaces have ports of their own


def wire_bytes() -> int:
    """Bytes this host's end of the link sent so far (a rank sees its own namespace's interface)."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


class Curve:
    """A probe for ``bench_lowcomm.run``: every ``every`` steps, the accuracy of the replicas' average."""

    def __init__(self, test: TensorDataset, every: int) -> None:
        self.test, self.every = test, every
        self.points: list[tuple[int, float, float, float]] = []  # (steps, seconds, MB sent, accuracy %)
        self.wire_off = 0  # link bytes of the evaluations' own averaging

    def __call__(self, steps: int, model: nn.Module, seconds: float, sent: float) -> float:
        if steps % self.every:
            return 0.0
        start, wire = time.perf_counter(), wire_bytes()
        names = [name for name, _ in model.named_parameters()]
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        with torch.random.fork_rng():  # mlp() seeds the global RNG: leave the training's as it was
            average = lowcomm.mlp()
        torch.nn.utils.vector_to_parameters(flat, average.parameters())
        assert names == [name for name, _ in average.named_parameters()], "the model's parameters changed order"
        self.points.append((steps, seconds, sent / 1e6, lowcomm.accuracy(average, self.test)))
        self.wire_off += wire_bytes() - wire
        return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    train, test = lowcomm.digits()
    results: dict[str, list[dict]] = {mode: [] for mode in args.mode}
    for seed in range(args.seeds):  # seed by seed, every mode within a seed: the machine's load hits all modes alike
        for mode in results:
            curve, before = Curve(test, args.eval_every), wire_bytes()
            acc, mb, seconds = lowcomm.run(mode, train, test, args.epochs, probe=curve, seed=seed)
            wire = torch.tensor([(wire_bytes() - before - curve.wire_off) / 1e6])
            dist.all_reduce(wire)
            results[mode].append({"seed": seed, "accuracy": acc, "mb": mb, "seconds": seconds, "points": curve.points,
                                  "wire_mb": float(wire) / dist.get_world_size()})
    if autodist.init().rank == 0:
        with open(os.path.join(args.out, "slow_link.json"), "w") as f:
            json.dump(results, f, indent=1)


def to_target(points: list, target: float) -> tuple[int, float] | None:
    """(steps, seconds) when the averaged model first reached ``target`` % accuracy."""
    return next(((steps, seconds) for steps, seconds, _, acc in points if acc >= target), None)


def median(values: list[float]) -> float:
    """The median; an infinite value (target not reached) counts as the largest."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def table(results: dict, target: float) -> str:
    """One row per mode: the medians over the seeds, and each seed's steps to ``target``."""
    exact = results.get("exact sync") or results.get("exact sync, AdamW")
    exact_mb = median([r["mb"] for r in exact]) if exact else float("nan")
    lines = [f"| mode | accuracy (%) | MB sent / rank (counted) | MB on the link / rank | less traffic than exact "
             f"| steps to {target:g}% | steps to {target:g}%, each seed | seconds to {target:g}% | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        reach = [to_target(r["points"], target) for r in runs]
        steps = median([float("inf") if x is None else x[0] for x in reach])
        seconds = median([float("inf") if x is None else x[1] for x in reach])
        each = ", ".join("-" if x is None else str(x[0]) for x in reach)
        mb = median([r["mb"] for r in runs])
        lines.append(f"| {mode} | {median([r['accuracy'] for r in runs]):.1f} | {mb:.2f} "
                     f"| {median([r['wire_mb'] for r in runs]):.2f} | {exact_mb / mb:.0f}x "
                     f"| {'not reached' if steps == float('inf') else f'{steps:g}'} | {each} "
                     f"| {'-' if seconds == float('inf') else f'{seconds:.2f}'} "
                     f"| {median([r['seconds'] for r in runs]):.1f} |")
    return "\n".join(lines)


def mean_curve(runs: list[dict]) -> list[tuple[float, float, float]]:
    """(seconds, MB sent, accuracy %) at each checked step, each the mean over the seeds."""
    return [tuple(sum(values) / len(values) for values in zip(*(p[1:] for p in same_step)))
            for same_step in zip(*(r["points"] for r in runs))]


def plot(results: dict, rate: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one row per inner optimizer: SGD with momentum, then AdamW
    rows = [[m for m in results if not m.endswith(", AdamW")], [m for m in results if m.endswith(", AdamW")]]
    rows = [row for row in rows if row]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 4.2 * len(rows)), sharey=True, squeeze=False)
    for (by_time, by_bytes), modes in zip(axes, rows):
        for mode in modes:
            points = mean_curve(results[mode])
            seconds, mb, acc = zip(*points) if points else ((), (), ())
            by_time.plot(seconds, acc, label=mode)
            by_bytes.plot(mb, acc, label=mode)
        by_time.set_xlabel("training seconds")
        by_bytes.set_xlabel("MB sent per rank")
        by_bytes.set_xscale("log")
        by_time.set_ylabel("test accuracy (%)")
        by_time.set_ylim(80, 100)
        by_time.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"digits, 2 hosts x 1 rank, link {rate}, mean of {len(next(iter(results.values())))} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_on_hosts(cluster: Any, script: str, options: list[str]) -> list[int]:
    """``script --worker OPTIONS`` on both hosts of ``cluster`` (``tests/cluster.py``), one rank on each through
    ``autodist run --nnodes 2``, one torch thread each, gloo on the link; each host's exit status, A's first.

    Example:
        >>> run_on_hosts(cluster, parser.script, parser.forwarded(args))
        [0, 0]
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"}
    worker = harness.worker_command(script, options)
    procs = []
    for node, host in enumerate(cluster.hosts):
        cmd = [sys.executable, "-m", "autodist", "run", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-endpoint", f"{cluster.a.addr}:{PORT}", "-n", "1", *worker]
        procs.append(cluster.popen(host, cmd, env=env | {"GLOO_SOCKET_IFNAME": host.dev}))
    return [p.wait() for p in procs]


def two_hosts(name: str, quick: bool) -> Any:
    """The two hosts of ``tests/cluster.py``, or None where this machine cannot make them (not root, no network
    namespaces), said on stderr: a benchmark's ``--quick`` then skips, as the tests of ``tests/cluster.py`` do.

    Example:
        >>> cluster = two_hosts("bench_slow_link", args.quick)
        >>> if cluster is None:
        ...     return 0 if args.quick else 2
    """
    sys.path.insert(0, TESTS)
    from cluster import ClusterUnavailable, make_cluster

    try:
        return make_cluster()
    except ClusterUnavailable as error:
        print(f"{name}{' --quick: skipped' if quick else ''}: cannot make the two hosts: {error}", file=sys.stderr)
        return None


def launch(parser: harness.Parser, args: argparse.Namespace) -> int:
    """The two hosts, one rank on each through ``autodist run --nnodes 2``; then the table and the plot."""
    cluster = two_hosts("bench_slow_link", args.quick)
    if cluster is None:
        return 0 if args.quick else 2
    with cluster:
        shown = args.out
        if args.quick:  # a smoke run never overwrites measured results
            shown = tempfile.mkdtemp(prefix="bench_slow_link_quick-")
            print(f"bench_slow_link --quick: writing to {shown}, not to {args.out}", flush=True)
        os.makedirs(shown, exist_ok=True)
        out = os.path.abspath(shown)
        if args.rate != "none":
            cluster.limit(args.rate)
        codes = run_on_hosts(cluster, parser.script, parser.forwarded(argparse.Namespace(**vars(args) | {"out": out})))
    if any(codes):
        print(f"bench_slow_link: the job failed (exit status {codes} on hosts A, B)", file=sys.stderr)
        return 1
    with open(os.path.join(out, "slow_link.json")) as f:
        results = json.load(f)
    plot(results, args.rate, os.path.join(out, "slow_link.png"))
    print(f"\n2 hosts x 1 rank, link {args.rate}, digits, {args.epochs} epochs, global batch {lowcomm.BATCH}, "
          f"accuracy checked every {args.eval_every} steps; medians over {args.seeds} seeds (initial weights "
          f"and data order)\n")
    print(table(results, args.target))
    print(f"\nplot: {os.path.join(shown, 'slow_link.png')}")
    return 0


def main() -> int:
    parser = harness.Parser(__file__, __doc__)  # 2 ranks: one on each host
    parser.add_argument("--out", required=True, help="folder for slow_link.json and slow_link.png")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate of the link, e.g. 100mbit, 1gbit, or none")
    parser.add_argument("--target", type=float, default=95.0, help="accuracy (%%) for the time-to-target column")
    parser.add_argument("--eval-every", type=int, default=lowcomm.PERIOD, help="steps between accuracy checks")
    parser.add_argument("--seeds", type=int, default=5, help="runs of every mode, from seeds 0, 1, ...")
    all_modes = lowcomm.MODES + lowcomm.ADAMW_MODES
    parser.add_argument("--mode", action="append", default=[], choices=all_modes, metavar="MODE",
                        help="run only this mode (repeat for several; the first should be 'exact sync'); of: "
                             + "; ".join(all_modes))
    # --quick: one epoch of one seed, written to a fresh temporary folder instead of --out
    args = parser.parse(quick={"epochs": 1, "seeds": 1})
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    args.mode = args.mode or list(all_modes)
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
