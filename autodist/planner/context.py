"""What ``cp=K`` makes of the model, for the planner: read from :func:`autodist.cp.explain.explain` (one forward of
the example, its attention calls watched), the bytes a rank sends for attention per batch row and step, the
whole sequence's keys and values a rank keeps for backward per row, and why ``cp=K`` cannot be made ("" where it
can): the model makes no attention call (nothing to split), its forward could not be watched, the batch is
``(tokens, batch)`` (the planner reads ``(batch, tokens)`` batches), the data is not a DataLoader (``cp`` cuts
batches as the loader hands them over), its tensors are not all ``(batch, tokens, ...)`` (a per-sample label
cannot be cut into tokens), the sequence is shorter than the cut's ``2K`` chunks. The search asks only where the
user asked for ``cp``, so every ``cp`` row it gets says what became of it.

Example:
    >>> found = contexts(gpt, (idx,), rows=2, degrees=[2, 4], loader=True, batch_dim=0)
    >>> found[2].sent_per_row, found[2].impossible
    (1572864.0, "")
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autodist.cp import explain as cp_explain
from autodist.cp.batches import SequenceCut
from autodist.planner.plan import Layout
from autodist.planner.step import untouched


@dataclass
class Context:
    """``cp=K`` read as bytes: sent per batch row and step (forward and backward, ring-moved), the attention
    calls (each an all-gather forward and an all-reduce backward), the gathered keys and values a rank keeps for
    backward per row (whole sequence: the part of them not its own is what ``cp`` adds to its activations), what
    one call holds for a moment in backward per row (the whole sequence's keys' and values' gradient before the
    ranks sum it, and the keys and values gathered again where it gathers anew: the largest call's), and why it
    cannot be made."""

    sent_per_row: float = 0.0
    calls: int = 0
    kept_per_row: float = 0.0
    impossible: str = ""
    transient_per_row: float = 0.0


def contexts(model: nn.Module, example: Any, rows: int, degrees: list[int], loader: bool,
             batch_dim: int) -> dict[int, Context]:
    """``cp=K`` for each ``K`` of ``degrees`` on ``example`` (``rows`` rows of a global batch), each with the reason
    where it cannot be made; ``loader``: the data is a DataLoader."""
    if batch_dim != 0:
        return {k: Context(impossible=f"the planner reads cp={k} from (batch, tokens) batches, and batch_dim="
                                      f"{batch_dim}: give cp={k} by hand (layout=autodist.Layout(cp={k}))")
                for k in degrees}
    try:
        with untouched(model):
            plans = {k: cp_explain.explain(model, k, example) for k in degrees}
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return {k: Context(impossible=f"cp={k}: the forward watched for attention calls failed ({why})")
                for k in degrees}
    return {k: _read(plan, example, rows, loader) for k, plan in plans.items()}


def _read(plan: cp_explain.ContextPlan, example: Any, rows: int, loader: bool) -> Context:
    k = plan.parts
    if not plan.calls:
        return Context(impossible=f"cp={k} finds no attention call in the model's forward to split the sequence for")
    if not loader:
        return Context(impossible=f"cp={k} cuts the batches of a DataLoader as it hands them over: pass the data "
                                  f"as one")
    if plan.length < 2 * k:
        return Context(impossible=f"cp={k} cuts each sequence into {2 * k} chunks, and it has {plan.length} tokens")
    try:
        SequenceCut(0, k, 1)(example)
    except ValueError as err:
        return Context(impossible=str(err).splitlines()[0])
    forward, backward = plan.sent()
    kept = sum(c.whole(plan.split) for c in plan.calls if not c.again)  # the "again" path gathers anew in backward
    transient = max(c.whole(plan.split) * (2 if c.again else 1) for c in plan.calls)
    return Context((forward + backward) / rows, len(plan.calls), kept / rows, transient_per_row=transient / rows)


def flat(layout: Layout) -> Layout:
    """``layout`` with its context-parallel ranks counted as data-parallel ones (a rank of ``dp x cp`` holding
    ``1/cp`` of each row's tokens is, but for attention, one of ``dp x cp`` holding ``1/cp`` of the rows)."""
    return replace(layout, dp=layout.dp * layout.cp, cp=1)
