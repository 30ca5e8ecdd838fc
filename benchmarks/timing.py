"""Timing helpers shared by the benchmarks: a timed training step, interleaved blocks, the summary.

Used by ``bench_dp.py``, ``bench_mp.py`` and ``bench_shapes.py`` (imported as ``timing``: a script's own
folder is first on ``sys.path``, under torchrun too); how they take options and start their ranks is
``harness.py``. Not a benchmark itself.

The method: every contender runs the same full training step; blocks of steps
of each contender alternate, the order flipping every round, so slow drift of
the machine (thermal, other load) lands on all of them alike. The headline is
the ratio of median step times; the paired ratio (median over rounds of the
ratio of the two blocks' medians in that round) cancels drift further.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Step = Callable[[], float]


def make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    """A closure that runs one full training step and returns its wall time in seconds (on a GPU, from an idle
    device to an idle device: what the step queued is counted)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        settle(x)
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        settle(x)
        return time.perf_counter() - start

    return step


def settle(t: torch.Tensor) -> None:
    """Wait for the GPU ``t`` lives on to finish its queued work (nothing on the CPU), before reading a clock."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def interleave(steps: dict[str, Step], block: int, rounds: int, warmup: int,
               before_block: Callable[[], None] = lambda: None) -> tuple[dict[str, list[float]], list[float]]:
    """Alternate blocks of each step function; return all step times per name and the per-round ratios.

    The order inside a round flips every round, so neither contender always
    runs right after the other (caches, allocator state). Every rank must call
    this with the same arguments: the blocks contain collectives. The per-round
    ratio is the second name's block median over the first's.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    paired: list[float] = []
    for r in range(rounds):
        block_medians: dict[str, float] = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            before_block()
            block_times = [steps[name]() for _ in range(block)]
            times[name] += block_times
            block_medians[name] = statistics.median(block_times)
        paired.append(block_medians[names[1]] / block_medians[names[0]])
    return times, paired


def describe(name: str, times: list[float], width: int = 10) -> str:
    """One line: min / quartiles / median of ``times`` (seconds) in milliseconds, the name padded to ``width``."""
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (f"  {name:<{width}} min {1e3 * min(times):7.2f}  q1 {1e3 * q1:7.2f}  median {1e3 * med:7.2f}  "
            f"q3 {1e3 * q3:7.2f} ms   ({len(times)} steps)")


def report(title: str, times: dict[str, list[float]], paired: list[float], goal: float) -> None:
    """Print the summary; the second name is the contender, the first the reference."""
    reference, contender = list(times)
    ratio = statistics.median(times[contender]) / statistics.median(times[reference])
    pq1, pmed, pq3 = statistics.quantiles(paired, n=4, method="inclusive")
    print(title)
    for name, ts in times.items():
        print(describe(name, ts))
    print(f"  ratio of medians {contender}/{reference}: {ratio:.3f}  (goal <= {goal:.2f}: "
          f"{'met' if ratio <= goal else 'NOT met'})")
    print(f"  paired per-round ratio: median {pmed:.3f}  quartiles {pq1:.3f} .. {pq3:.3f}  ({len(paired)} rounds)",
          flush=True)
