"""Local SGD (model averaging, MALT-2's dstsgd): replicas step alone and average their weights every H steps."""
from __future__ import annotations

import torch

from autodist.sync.periodic import Periodic


class LocalSGD(Periodic):
    """Each replica takes ``every`` optimizer steps on its own data, then all replicas average their
    parameters and floating-point buffers, each weighted by the samples it trained on since the last
    average; the first ``warmup`` steps are synchronized exactly (gradients averaged at every backward).

    Args:
        every: optimizer steps between two averages (H).
        warmup: optimizer steps of exact sync before the local steps begin.

    What it promises instead of exactness:
        * right after each average every replica holds the very same parameters and buffers;
        * with ``every=1`` and plain SGD (no momentum, no weight decay) it computes the exact run: the
          samples-weighted average of the replicas' steps is the step on the global batch's gradient;
        * it sends one model (parameters + float buffers) per ``every`` steps instead of one gradient per
          step: about ``every`` times fewer bytes than exact sync (``bytes_sent``, which counts the
          warm-up's exact steps too).
        Between averages the replicas differ (``spread()`` says by how much), and optimizer state
        (momentum, Adam's moments) stays local, never averaged. ``autodist.save`` keeps the step count, so
        a restart averages at the same steps. Saved right after an average, with an optimizer whose state is
        the same on every replica (plain SGD), the restart is the uninterrupted run; otherwise every replica
        restarts from rank 0's model and optimizer state (what the checkpoint holds).

    Example:
        >>> model, loader = autodist.parallelize(model, loader, sync=autodist.LocalSGD(every=16))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for x, y in loader:                 # the ordinary loop, unchanged
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()                # every 16th step averages the replicas

    Note:
        Steps are counted through ``optimizer.step()`` of any optimizer holding the model's parameters
        (see :mod:`autodist.sync.stepping`): use one optimizer per model, and every rank must take the
        same number of steps. At the end of training call ``autodist.synchronize_model(model,
        what="parameters")`` (or save right after an average) to end with one model.
    """

    name = "local SGD"

    def __init__(self, *, every: int = 16, warmup: int = 0) -> None:
        super().__init__(every, warmup)

    def _sync(self) -> None:
        averaged = self._average(self.tensors).wait()
        with torch.no_grad():
            for t, a in zip(self.tensors, averaged):
                t.copy_(a)

    def __repr__(self) -> str:
        return f"LocalSGD(every={self.every}, warmup={self.warmup})"
