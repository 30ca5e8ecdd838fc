"""Whether 1F1B's weighting of micro-batches by their samples is the one-process mean of a loss over valid tokens.

1F1B (``pp`` with ``loss_fn=``) runs each micro-batch's backward before the next micro-batch's loss exists, so
it weights each by its samples. A loss that is a mean over valid tokens (labels at -100: a prompt, padding) is
then exact where every micro-batch of every replica has as many valid tokens a sample: the samples' weights are
the tokens' then. That is so for a Hugging Face causal language model without padding (its labels are shifted
by one, so each row has exactly one ignored position), and not where padding or masks differ from row to row.

:class:`TokensPerSample` reads each micro-batch's valid tokens from its loss (:mod:`autodist.dp.loss_reading`)
and, at the step's end, says whether they differ over the step's micro-batches and replicas (one all-reduce of
three numbers over the last stage's data-parallel group a step, until it has said so once).

Example:
    >>> check = TokensPerSample()
    >>> for loss, samples in micro_batches:
    ...     check.note(loss, samples)
    >>> problem = check.settle(group, device)   # a collective; None where the weighting is exact
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autodist.dp.loss_reading import read
from autodist.runtime.position import waiting


class TokensPerSample:
    """Valid tokens a sample of the micro-batches of one step, checked as said in the module docstring."""

    def __init__(self) -> None:
        self.ratios: list[float] = []  # this step's micro-batches: valid tokens over samples
        self.uneven = False  # a micro-batch's loss ignored some of its targets (or weighted them)

    @torch.compiler.disable  # it walks autograd's nodes (outside a compiled forward's graph, as it always ran)
    def note(self, loss: torch.Tensor, samples: float) -> None:
        """One micro-batch's loss (before its backward, which frees what the reading needs) and its samples."""
        reading = read([loss])
        if reading.count is None:
            return
        self.uneven = self.uneven or reading.uneven()
        if samples:  # a replica standing in for rows it holds none of weighs nothing
            self.ratios.append(reading.count / samples)

    def settle(self, group: Any, device: torch.device) -> str | None:
        """At a step's end: why weighting by samples is not the mean over the step's valid tokens, or None where
        it is; with ``group`` (the last stage's data-parallel ranks, every one calling this alike) over every
        replica's micro-batches, by one all-reduce of three numbers."""
        ratios, uneven = self.ratios, self.uneven
        self.ratios, self.uneven = [], False
        low, high = (min(ratios), max(ratios)) if ratios else (float("inf"), float("-inf"))
        replicas = group is not None and dist.get_world_size(group) > 1
        if replicas:
            agreed = torch.tensor([float(uneven), high, -low], dtype=torch.float64, device=device)
            with waiting("the valid tokens a sample of every replica's micro-batches (1F1B)"):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            uneven, high, low = bool(agreed[0]), float(agreed[1]), -float(agreed[2])
        if not uneven or high < low or abs(high - low) <= 1e-9 * max(abs(high), 1.0):
            return None
        where = "micro-batches and replicas" if replicas else "micro-batches"
        return f"valid tokens a sample from {low:g} to {high:g} over this step's {where}"
