"""DiLoCo: the user's optimizer steps locally; every H steps an outer optimizer steps on the averaged delta."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autodist.sync.averaging import weighted_average_
from autodist.sync.base import SyncContext
from autodist.sync.periodic import Periodic


class DiLoCo(Periodic):
    """Inner steps with the user's optimizer; every ``every`` steps the outer step.

    The replicas start each round from the same *outer* parameters theta. After
    ``every`` inner steps, the outer gradient is the samples-weighted average
    over replicas of theta - theta_r (how far each replica moved), and an outer
    SGD (``outer_lr``, ``momentum``, Nesterov by default) steps theta with it;
    every replica then continues from the new theta. Floating-point buffers
    (BatchNorm statistics) are averaged as in :class:`LocalSGD`.

    Args:
        every: inner optimizer steps per outer step (H).
        outer_lr: the outer SGD's learning rate.
        momentum: the outer SGD's momentum (0 for none).
        nesterov: Nesterov momentum (ignored when ``momentum`` is 0).
        warmup: optimizer steps of exact sync before the inner steps begin.

    What it promises instead of exactness:
        * after each outer step every replica holds the very same parameters (the outer ones);
        * with ``outer_lr=1`` and ``momentum=0`` it is :class:`LocalSGD` (the outer step lands on the
          weighted average of the replicas);
        * one model's worth of bytes per ``every`` steps (``bytes_sent``).
        A restart needs the outer state (theta, its momentum, the step count): save it as an extra,
        ``autodist.save(path, model, optimizer, diloco=diloco.state_dict())``, and give it back with
        ``diloco.load_state_dict(autodist.load(path, model, optimizer)["diloco"])``.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, sync=autodist.DiLoCo(every=64))
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)    # the inner optimizer
        >>> for x, y in loader:
        ...     optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

    Note:
        As for :class:`LocalSGD`: one optimizer per model, the same number of steps on every rank.
    """

    name = "DiLoCo"

    def __init__(self, *, every: int = 64, outer_lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                 warmup: int = 0) -> None:
        super().__init__(every, warmup)
        if not (isinstance(outer_lr, (int, float)) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.outer_lr, self.momentum, self.nesterov = float(outer_lr), float(momentum), bool(nesterov)

    def _start(self, model: nn.Module, ctx: SyncContext) -> Any:
        exact = super()._start(model, ctx)
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.outer_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.outer_params, lr=self.outer_lr, momentum=self.momentum,
                                     nesterov=self.nesterov and self.momentum > 0)
        return exact

    def _begin_local(self) -> None:
        with torch.no_grad():
            for outer, p in zip(self.outer_params, self.params):
                outer.copy_(p)

    def _sync(self) -> None:
        with torch.no_grad():
            deltas = [outer - p.detach() for outer, p in zip(self.outer_params, self.params)]
            weighted_average_(deltas + self.buffers, self.tally.count, self._comm,  # type: ignore[arg-type]
                              self.tally.error)
            for outer, delta in zip(self.outer_params, deltas):
                outer.grad = delta
            self.outer.step()
            for outer, p in zip(self.outer_params, self.params):
                p.copy_(outer)
                outer.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The outer parameters, the outer optimizer's state and the step count (what a restart needs)."""
        return {"steps": self.steps, "syncs": self.syncs, "outer_params": [t.clone() for t in self.outer_params],
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["outer_params"]
        if len(saved) != len(self.outer_params) or any(s.shape != o.shape for s, o in zip(saved, self.outer_params)):
            raise ValueError(f"the saved DiLoCo state holds {len(saved)} outer parameters of shapes "
                             f"{[tuple(s.shape) for s in saved][:4]}..., the model {len(self.outer_params)}: load "
                             f"it into the model it was saved from")
        with torch.no_grad():
            for outer, s in zip(self.outer_params, saved):
                outer.copy_(s)
        self.outer.load_state_dict(state["outer"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])

    def __repr__(self) -> str:
        return (f"DiLoCo(every={self.every}, outer_lr={self.outer_lr}, momentum={self.momentum}, "
                f"nesterov={self.nesterov}, warmup={self.warmup})")
