"""Asynchronous EASGD (Zhang, Choromanska, LeCun 2015): workers step alone, an elastic force ties them to a center."""
from __future__ import annotations

import torch

from autodist.ps import wire
from autodist.ps.layout import flatten, unflatten_into
from autodist.ps.strategy import ParameterServer, _positive


class EASGD(ParameterServer):
    """Each worker takes its own optimizer's steps; every ``every`` steps it meets the center variable the
    servers hold, asynchronously: with ``e = alpha (x_worker - center)``, the worker moves to ``x - e`` and the
    center to ``center + e`` (one atomic update on each server, the moment the worker's request arrives).

    Args:
        every: local optimizer steps between two elastic moves (tau).
        alpha: the elastic force; default ``0.9 / P`` for P workers (the paper's beta = 0.9).
        servers: how many ranks (0 .. servers-1) hold a shard of the center.
        staleness: a worker more than ``staleness`` moves ahead of the slowest unfinished worker waits.

    What it promises instead of exactness:
        * each elastic move is exactly the formula above on the center as it is when the request arrives (a
          one-worker run is the EASGD recursion, step for step; tests check it);
        * workers never wait for each other (unless ``staleness`` is set); convergence in practice;
        * the center starts as the model at the first ``optimizer.step()`` (after a checkpoint was loaded);
        * when a pass over the loader ends, and after :meth:`close`, the model holds the center, and training
          continues from it.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, sync=autodist.EASGD(every=4))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.05)   # each worker's own
        >>> ...                                                        # the ordinary loop
    """

    name = "EASGD"

    def __init__(self, *, every: int = 4, alpha: float | None = None, servers: int = 1,
                 staleness: int | None = None) -> None:
        super().__init__(servers=servers, staleness=staleness)
        self.every = _positive("every", every)
        if alpha is not None and not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
        self.alpha = alpha

    def _alpha(self, world: int) -> float:
        return self.alpha if self.alpha is not None else 0.9 / world

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.started:
            self._send_init(None)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.clock += 1
            x = flatten(self.params)
            replies = self._exchange(wire.ELASTIC, self._slices(x))
            unflatten_into(x - torch.cat([r.floats for r in replies]), self.params)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"EASGD(every={self.every}, alpha={self.alpha}, servers={self.servers}, staleness={self.staleness})"
