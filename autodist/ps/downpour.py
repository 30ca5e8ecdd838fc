"""Downpour SGD (Dean et al. 2012): workers push gradients, the servers' optimizer applies them as they come."""
from __future__ import annotations

from typing import Any

import torch

from autodist.ps import wire
from autodist.ps.layout import flatten
from autodist.ps.strategy import ParameterServer, _positive


class Downpour(ParameterServer):
    """Asynchronous SGD through parameter servers.

    Your optimizer, as you built it, moves to the servers: at the first
    ``optimizer.step()`` each server builds the same class with the same
    hyperparameters over its shard (the flat parameter vector cut by size over
    ranks ``0 .. servers-1``). From then on ``optimizer.step()`` on a worker
    updates nothing locally: every ``every`` steps it pushes the sum of its
    gradients since the last push to the servers, each applies it with its
    optimizer the moment it arrives (no waiting for other workers), and the
    worker continues from the parameters the servers send back. Changed
    hyperparameters (a learning-rate schedule) travel with the next push.

    Args:
        every: optimizer steps per push (gradients summed in between).
        servers: how many ranks (0 .. servers-1) hold a shard.
        staleness: bounded staleness: a worker more than ``staleness`` pushes ahead of the slowest unfinished
            worker waits for it (None: never waits; 0: lock-step rounds).

    What it promises instead of exactness:
        * with one worker it is your optimizer on that worker's batches, exactly (tests check it);
        * with several, each push is applied to parameters that other workers may have moved since the pushing
          worker fetched them: at most ``staleness`` pushes behind per worker when the bound is set
          (``max_lead`` says how far ahead this worker ever ran); convergence in practice, not the exact run;
        * a worker that dies is dropped and the others go on; a server that dies ends the job with
          :class:`~autodist.ps.strategy.ServerLost`;
        * when a pass over the loader ends, and after :meth:`close`, the model holds the servers' parameters.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, sync=autodist.Downpour())
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)   # runs on the servers
        >>> for epoch in range(epochs):
        ...     for x, y in loader:
        ...         optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        ...     evaluate(model)                   # the servers' current parameters
    """

    name = "Downpour"

    def __init__(self, *, every: int = 1, servers: int = 1, staleness: int | None = None) -> None:
        super().__init__(servers=servers, staleness=staleness)
        self.every = _positive("every", every)
        self._hidden: list[torch.Tensor | None] = []
        self._sum: torch.Tensor | None = None
        self._hyper: list[dict[str, Any]] | None = None

    def _spec(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [({k: v for k, v in g.items() if k != "params"}, [index[id(p)] for p in g["params"] if id(p) in index])
                  for g in optimizer.param_groups]
        cls = type(optimizer)
        return {"class": (cls.__module__, cls.__qualname__), "defaults": dict(optimizer.defaults), "groups": groups}

    @staticmethod
    def _scalars(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                for g in optimizer.param_groups]

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.started:
            self._send_init(self._spec(optimizer))
            self._hyper = self._scalars(optimizer)
            self._sum = torch.zeros(self.layout.total)
        self._changed = None
        hyper = self._scalars(optimizer)
        if hyper != self._hyper:
            self._changed, self._hyper = hyper, hyper
        self._hidden = [p.grad for p in self.params]
        for p in self.params:  # the local optimizer skips parameters without a gradient: the servers step
            p.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, g in zip(self.params, self._hidden):
            p.grad = g
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, self._hidden)]
        self._hidden = []
        self._sum.add_(flatten(grads))  # type: ignore[union-attr]
        self.steps += 1
        if self.steps % self.every == 0:
            self._push()

    def _push(self) -> None:
        self.clock += 1
        replies = self._exchange(wire.PUSH, self._slices(self._sum), self._changed)  # type: ignore[arg-type]
        self._changed = None
        self._sum.zero_()  # type: ignore[union-attr]
        self._set_params(replies)

    def _hand_back(self) -> None:
        if self.steps % self.every:
            self._push()

    def __repr__(self) -> str:
        return f"Downpour(every={self.every}, servers={self.servers}, staleness={self.staleness})"
