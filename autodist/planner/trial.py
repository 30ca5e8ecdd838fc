"""The finalists measured: each a deep copy of the model parallelized with its layout, steps of the optimizer
the plan assumes on this rank's share of one global batch, its time (the slowest rank's median step, after
two untimed ones) and its peak (what the rank holds at rest, ``autodist.memory``, plus the most a step makes
above it). The finalists' steps are interleaved where they fit in memory together. The user's model, its
gradients and the random streams are left as they were: the training that follows is the chosen layout's,
from the same start. Every rank runs every trial.

Example:
    >>> make = [partial(Trial, model, batch, layout, setup, 2, rank) for layout in finalists]
    >>> [r.seconds for r in run_all(make, steps=5, together=True)]
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from autodist.cp import forward as cp_forward
from autodist.planner.live import LiveBytes
from autodist.planner.plan import Layout
from autodist.planner.step import loss_of, make_optimizer, rng_state, set_rng_state
from autodist.runtime import plain, tree
from autodist.train.memory import memory

Setup = Callable[..., tuple[nn.Module, Any]]  # parallelize without its log line
_UNREAD = 1024  # rows of the loader a context-parallel trial is given and never reads


@dataclass
class Result:
    seconds: float
    peak: float
    kinds: dict[str, float]


def share(example: Any, index: int, parts: int, dim: int) -> Any:
    """Part ``index`` of ``parts`` of every tensor of the batch along ``dim``, as the data is sharded; a part
    with no row is the first row, as a sharded loader hands a rank left with none a stand-in row (whose gradient
    counts zero) to run the step with the others."""
    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        part = torch.tensor_split(t, parts, dim=dim)[index]
        return part if part.shape[dim] or not t.shape[dim] else t.narrow(dim, 0, 1)
    return tree_map(cut, example)


def _slowest(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class PipelineTrialFailed(Exception):
    """A finalist with pipeline stages failed on some of its stages: not a layout that merely cannot be made (the
    others are inside its pipeline, waiting on the failed stage), so the search cannot go on."""


class Trial:
    """A copy of ``model`` parallelized as ``layout``, warmed up (the optimizer's state made) and its peak
    measured; :meth:`step` times one more step (the slowest rank's time); :meth:`close` frees it."""

    def __init__(self, model: nn.Module, batch: Any, layout: Layout, setup: Setup, states: int, rank: int,
                 dim: int = 0, options: dict[str, Any] | None = None, target: Any = None) -> None:
        # cp cuts the batches a DataLoader hands over: one is given (never read), and the rows cut as it would
        loader = DataLoader(range(_UNREAD), batch_size=_UNREAD) if layout.cp > 1 else None
        self.model, _ = setup(copy.deepcopy(model), loader, **{**(options or {}), **layout.options()})
        replica = rank // (layout.mp * layout.pp * layout.cp)
        self.x = share(batch, replica, layout.dp, dim)
        # with loss_fn= the step is loss = model(x, target=y), as that loop runs it (under pp, 1F1B)
        self.target = None if target is None else share(target, replica, layout.dp, dim)
        if layout.cp > 1:
            self.x = cp_forward.context_of(self.model).cut(self.x)
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.optimizer = make_optimizer(self.model.parameters(), states)
        self.times: list[float] = []
        try:
            self.run()  # the optimizer's state; the first of everything
        except Exception as err:
            if layout.pp > 1:  # the other stages wait on this one's sends: no agreement can be reached
                raise PipelineTrialFailed(
                    f"plan: the finalist {layout} failed on this rank inside its pipeline ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}), and the other stages wait on it, so the "
                    f"search stops here: choose the layout yourself (layout=autodist.Layout(...))") from err
            raise
        self.optimizer.zero_grad()
        at_rest = memory(self.model, self.optimizer).total
        with LiveBytes() as live:
            self.run()
        self.kinds = dict(memory(self.model, self.optimizer))
        self.peak = _slowest(at_rest + live.peak, self.device)

    def run(self) -> None:
        """One step, untimed."""
        self.optimizer.zero_grad()
        loss_of(tree.call(self.model, self.x) if self.target is None else
                tree.call(partial(self.model, target=self.target), self.x)).backward()
        self.optimizer.step()

    def step(self) -> None:
        start = time.perf_counter()
        self.run()
        self.times.append(_slowest(time.perf_counter() - start, self.device))

    def result(self) -> Result:
        return Result(statistics.median(self.times), self.peak, self.kinds)

    def close(self) -> None:
        self.model = self.optimizer = self.x = None
        gc.collect()


def _built(build: Callable[[], Trial]) -> Trial | str:
    """The trial, or why its layout cannot be made (the same on every rank: a model-parallel plan that does
    not fit the model's forward, say, is found alike by every rank from the same batch), agreed by all."""
    try:
        made: Trial | str = build()
    except (RuntimeError, NotImplementedError, ValueError) as error:
        made = f"{type(error).__name__}: {error}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = plain.all_gather(isinstance(made, str))
        if any(failed) and not all(failed):
            here = made if isinstance(made, str) else "made here"
            raise RuntimeError(f"plan: a finalist could be made on some ranks and not on others ({here}); pin "
                               f"the layout yourself (mp=, shard=)")
    return made


def run_all(make: list[Callable[[], Trial]], steps: int, together: bool) -> list[Result | str]:
    """Every trial's result, or why its layout could not be made; ``together``: all alive at once, their steps
    interleaved (one step of each in turn, the order reversed every round, so the machine's drift lands on
    all alike), else one after the other. The random streams are put back after each trial is made and after
    all have run."""
    rng = rng_state()
    results: list[Result | str | None] = [None] * len(make)
    trials: list[Trial] = []
    try:
        if together:
            made = []
            for build in make:
                made.append(_built(build))
                set_rng_state(rng)
            trials = [t for t in made if not isinstance(t, str)]
            for r in range(steps):
                for trial in (trials if r % 2 == 0 else trials[::-1]):
                    trial.step()
            return [t if isinstance(t, str) else t.result() for t in made]
        for i, build in enumerate(make):
            trial = _built(build)
            set_rng_state(rng)
            if isinstance(trial, str):
                results[i] = trial
                continue
            try:
                for _ in range(steps):
                    trial.step()
                results[i] = trial.result()
            finally:
                trial.close()
                set_rng_state(rng)
        return results  # type: ignore[return-value]
    finally:
        for trial in trials:
            trial.close()
        set_rng_state(rng)
