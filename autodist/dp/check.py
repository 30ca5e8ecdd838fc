"""``parallelize(..., check=loss)``: rank 0 computes one process's gradient of a step's global batch and compares.

autodist gives one process's training wherever it can read what couples the batch (a mean over tokens,
BatchNorm, a load-balancing loss; ``whole_batch`` for in-batch negatives). A loss it cannot read (a statistic
over the batch, negatives taken from the rank's own rows, a normalization by a count the loss does not divide
by) trains something else without a sound. The check makes that loud: before the optimizer steps on a checked
step, rank 0 copies the model (an ordinary module, autodist's hooks left out), collates the step's global batch
as the single-process loader does (its samples again, or the stream's batch every rank read), runs ``loss(copy,
batch).backward()`` and compares each parameter's gradient with the synchronized one. A difference beyond the
float floor raises on every rank, naming the first parameter that differs and the likely cause.

Cost, on the checked steps only: one forward and backward of the whole global batch on rank 0, a copy of the
model there, the batch collated again; the other ranks wait at the optimizer step. RNG states are put back, so
dropout draws in the copy change nothing of the training. Off by default.

Example:
    >>> model, loader = autodist.parallelize(model, loader, check=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    >>> # the first step raises if its gradient is not one process's
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autodist.dp import step_hooks
from autodist.runtime import plain, provenance
from autodist.runtime.position import waiting
from autodist.runtime.world import log

LossOf = Callable[[nn.Module, Any], torch.Tensor]

# a parameter's gradient differs when its largest difference exceeds this fraction of the largest gradient of
# the model: a few hundred times each dtype's rounding of a sum split over ranks, far below what a loss weighted
# otherwise moves (a few percent)
_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Check:
    """What ``parallelize(..., check=...)`` compares: ``loss(model, batch)`` on the step's global batch, on the
    first step and then every ``every`` steps (None: the first only).

    Example:
        >>> autodist.parallelize(model, loader, check=autodist.Check(loss_of, every=1000))
    """

    loss: LossOf
    every: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(f"check= takes loss(model, batch) -> the loss of one batch, a callable; got "
                            f"{type(self.loss).__name__}")
        if self.every is not None and (not isinstance(self.every, int) or isinstance(self.every, bool)
                                       or self.every < 1):
            raise ValueError(f"Check(every=...) must be a positive number of steps or None, got {self.every!r}")


class Checker:
    """The check of one parallelized model's steps (see the module docstring), listening to optimizer steps."""

    def __init__(self, model: nn.Module, sync: Any, check: Check, group: Any, rank: int) -> None:
        self.model, self.sync, self.check, self.group, self.rank = weakref.ref(model), sync, check, group, rank
        self.ids = {id(p) for p in model.parameters()}
        self.steps = 0
        provenance.keep_batches(True)
        step_hooks.listen(self)
        weakref.finalize(model, provenance.keep_batches, False)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        model = self.model()
        if model is None or not any(id(p) in self.ids for g in optimizer.param_groups for p in g["params"]):
            return
        step, self.steps = self.steps, self.steps + 1
        if step == 0 or (self.check.every and step % self.check.every == 0):
            self._compare(model, step)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def _compare(self, model: nn.Module, step: int) -> None:
        share = provenance.current()
        verdict = None
        if self.rank == 0:
            if share is None or share.whole is None:
                log.warning("autodist's check: step %d has no batch of the DataLoader parallelize returned in hand, "
                            "so it is not checked", step)
            elif self.sync.last_backwards != 1:
                log.warning("autodist's check: step %d accumulated %d backwards; only a step of one backward is "
                            "checked", step, self.sync.last_backwards)
            else:
                verdict = self._verdict(model, share.whole(), step)
        with waiting("autodist's check of this step (rank 0 computes one process's gradient)"):
            verdict = plain.broadcast(verdict, 0, self.group)
        if verdict is not None:
            raise RuntimeError(verdict)

    def _verdict(self, model: nn.Module, batch: Any, step: int) -> str | None:
        """Rank 0: one process's gradient of ``batch`` against the synchronized one; the message if they differ."""
        states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        twin = copy.deepcopy(model)
        try:
            twin.zero_grad(set_to_none=True)
            self.check.loss(twin, batch).backward()
        finally:
            torch.set_rng_state(states[0])
            if states[1] is not None:
                torch.cuda.set_rng_state_all(states[1])
        ours = dict(model.named_parameters())
        theirs = dict(twin.named_parameters())
        scale = max((float(p.grad.detach().abs().max()) for p in theirs.values() if p.grad is not None
                     and p.grad.numel()), default=0.0)
        for name, p in theirs.items():
            mine = ours[name].grad
            if (mine is None) != (p.grad is None):
                return self._message(model, step, name, "has a gradient in one of the two runs only")
            if mine is None:
                continue
            floor = _FLOOR.get(p.dtype, 1e-4) * max(scale, 1e-30)
            difference = float((mine.detach().to(p.grad.dtype) - p.grad).abs().max()) if mine.numel() else 0.0
            if difference > floor:
                return self._message(model, step, name, f"differs by {difference:.3g} (the largest gradient of the "
                                                        f"model is {scale:.3g}; the float floor here {floor:.3g})")
        log.info("autodist's check: step %d's gradient is one process's (every parameter within %.0e of the "
                 "largest gradient)", step, _FLOOR.get(next(iter(theirs.values())).dtype, 1e-4) if theirs else 0)
        return None

    def _message(self, model: nn.Module, step: int, name: str, what: str) -> str:
        return (f"autodist's check: at step {step} the gradient of parameter {name!r} {what} between this parallel "
                f"run and one process on the same global batch. Likely cause: {self._cause(model)}. "
                f"docs/data-parallel.md, 'Losses that couple the batch', says what autodist reads and the one line "
                f"for what it cannot")

    def _cause(self, model: nn.Module) -> str:
        causes = []
        dropout = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)
                        and m.training and m.p > 0), None)
        if dropout is not None:
            causes.append(f"the model draws random numbers in its forward (dropout at {dropout!r}), whose masks "
                          f"differ between the two runs: check a step with dropout off")
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()) \
                and not self.sync.coupled:
            causes.append("BatchNorm layers normalize by each rank's rows (batch_norm='local')")
        reading = self.sync.last_reading
        unread = sorted({t.node for t in reading.terms if t.kind in ("other", "mean")}) if reading else []
        if self.sync.counter.samples is not None:
            causes.append("samples= counts this rank's weight, and the loss is not a mean over that count")
        causes.append("a loss that couples the batch's samples where autodist cannot read it"
                      + (f" (terms ending in {', '.join(unread)})" if unread else "")
                      + ": a statistic over the batch, negatives from this rank's rows (autodist.whole_batch gives "
                        "the whole batch's), a normalization by a count the loss does not divide by")
        return "; or ".join(causes)
