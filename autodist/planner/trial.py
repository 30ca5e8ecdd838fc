"""A finalist measured: a deep copy of the model parallelized with the layout, a few steps of the optimizer
the plan assumes on this rank's share of one global batch, its time (the slowest rank's median step, the
first step left out as a warm-up) and its peak (what the rank holds at rest, ``autodist.memory``, plus the
most a step makes above it). The user's model, its gradients and the random streams are left as they were:
the training that follows is the chosen layout's, from the same start. Every rank runs every trial.

Example:
    >>> result = run(model, batch, Layout(dp=2, mp=1, shard="optimizer"), setup, states=2, steps=4)
    >>> result.seconds, result.peak
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autodist.mp import observe
from autodist.planner.live import LiveBytes
from autodist.planner.plan import Layout
from autodist.planner.profile import loss_of, make_optimizer, rng_state, set_rng_state
from autodist.train.memory import memory

Setup = Callable[..., tuple[nn.Module, Any]]  # parallelize without its log line


@dataclass
class Result:
    seconds: float
    peak: float
    kinds: dict[str, float]


def share(example: Any, index: int, parts: int, dim: int) -> Any:
    """Part ``index`` of ``parts`` of every tensor of the batch along ``dim``, as the data is sharded."""
    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        return torch.tensor_split(t, parts, dim=dim)[index]
    return tree_map(cut, example)


def _slowest(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(model: nn.Module, batch: Any, layout: Layout, setup: Setup, states: int, steps: int, rank: int,
        dim: int = 0, options: dict[str, Any] | None = None) -> Result:
    """Parallelize a copy of ``model`` as ``layout`` and run ``steps`` steps on this rank's share of ``batch``."""
    rng = rng_state()
    try:
        trial, _ = setup(copy.deepcopy(model), None, **layout.options(), **(options or {}))
        x = share(batch, rank // layout.mp, layout.dp, dim)
        device = next((p.device for p in trial.parameters()), torch.device("cpu"))
        optimizer = make_optimizer(trial.parameters(), states)

        def step() -> None:
            optimizer.zero_grad()
            loss_of(observe.call(trial, x)).backward()
            optimizer.step()

        step()  # the optimizer's state; the first of everything
        optimizer.zero_grad()
        at_rest = memory(trial, optimizer).total
        with LiveBytes() as live:
            step()
        kinds = dict(memory(trial, optimizer))
        times = []
        for _ in range(max(1, steps - 2)):
            start = time.perf_counter()
            step()
            times.append(_slowest(time.perf_counter() - start, device))
        peak = _slowest(at_rest + live.peak, device)
        return Result(statistics.median(times), peak, kinds)
    finally:
        trial = optimizer = None  # noqa: F841 - the copy goes before the next trial
        gc.collect()
        set_rng_state(rng)
