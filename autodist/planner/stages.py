"""What ``pp=K`` makes of the model, for the planner: each block's parameter bytes, the bytes autograd keeps in it
and its time, measured once (:func:`measure_blocks`, the pipeline's own measure), then cut as the pipeline cuts
(:func:`autodist.pp.cut.balance`) into each degree's stages (:func:`stages_of`).

A stage holds the parameters outside the blocks (the embedding, the head: every stage keeps them) and its blocks';
under GPipe it keeps what autograd saves in its blocks for every micro-batch of the rank's rows until their
backwards, the last stage the head's too (what the model keeps outside its blocks, taken as the last stage's), and
the activations it received. Its time is its share of the forward/backward (the head's on the last), stretched by
the pipeline's bubble, plus the sends between stages.

Example:
    >>> blocks = measure_blocks(model, names, example, rows=8)
    >>> stages_of(blocks, 2)[1].block_bytes        # the second stage's blocks' parameter bytes
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autodist.pp import cut as pp_cut
from autodist.pp import micro
from autodist.pp.hollow import hollow
from autodist.pp.schedule import bubble
from autodist.runtime import tree


@dataclass
class Blocks:
    """Per block, in order: parameter bytes, bytes autograd keeps per row, seconds of forward and backward per row,
    bytes of its output per row; the head's seconds per row (after the last block)."""

    params: list[float] = field(default_factory=list)
    saved: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    head: float = 0.0


@dataclass
class Stage:
    """One stage of a cut: its blocks' parameter bytes, share of the blocks' saved bytes and of the time."""

    blocks: int
    block_bytes: float
    saved_per_row: float
    seconds_per_row: float  # its blocks' (and on the last stage, the head's) forward and backward
    received_per_row: float  # bytes of the activations it receives from the stage before (none on the first)
    last: bool
    largest_saved_per_row: float = 0.0  # its largest block's (what recomputing one block holds, checkpointed)
    sent_per_row: float = 0.0  # bytes of its output, kept for the backward the next stage sends (none on the last)
    index: int = 0  # its place in the pipeline, from 0


def measure_blocks(model: nn.Module, names: list[str], example: Any, rows: int) -> Blocks:
    """Each block of ``names`` measured on ``example`` (``rows`` rows), as the pipeline measures them to cut."""
    modules = dict(model.named_modules())
    params = [float(sum(p.numel() * p.element_size() for p in modules[n].parameters())) for n in names]
    held = [float(sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in modules[n].parameters()))
            for n in names]
    seconds, sizes, head, sent = pp_cut.measure(model, names, example)
    saved = [max(0.0, s - h) / rows for s, h in zip(sizes, held)]
    return Blocks(params, saved, [s / rows for s in seconds], [b / rows for b in sent], head / rows)


def bounds_of(blocks: Blocks, pp: int) -> list[int]:
    """Where each of ``pp`` stages begins, as the pipeline cuts by the same measures (the time and bytes of each
    block), and the end."""
    held = [4 * p + s for p, s in zip(blocks.params, blocks.saved)]  # as pp.cut counts: weights, grads, 2 states
    return pp_cut.balance(blocks.seconds, [int(h) for h in held], pp, blocks.head)


def counts(bounds: list[int]) -> list[int]:
    """The blocks of each stage: ``parallelize``'s ``stages=``."""
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def stages_of(blocks: Blocks, pp: int) -> list[Stage]:
    """The stages of ``pp`` as the pipeline cuts them (:func:`bounds_of`)."""
    bounds = bounds_of(blocks, pp)
    stages = []
    for s in range(pp):
        lo, hi = bounds[s], bounds[s + 1]
        last = s == pp - 1
        stages.append(Stage(hi - lo, sum(blocks.params[lo:hi]), sum(blocks.saved[lo:hi]),
                            sum(blocks.seconds[lo:hi]) + (blocks.head if last else 0.0),
                            blocks.sent[lo - 1] if lo > 0 else 0.0, last, max(blocks.saved[lo:hi], default=0.0),
                            0.0 if last else blocks.sent[hi - 1], s))
    return stages


def in_flight(stage: Stage, pp: int, pieces: int, one_f_one_b: bool) -> int:
    """The micro-batches whose activations ``stage`` holds at once: every one under GPipe (all forwards, then
    the backwards), at most ``pp - s`` under 1F1B (stage ``s`` runs a backward after each forward from then on)."""
    return min(pieces, pp - stage.index) if one_f_one_b else pieces


def pieces(pp: int, rows: float, microbatches: int | None = None) -> int:
    """The micro-batches a batch of ``rows`` rows is cut into (``parallelize``'s default: ``2 * pp``, at most a
    row each)."""
    return max(1, min(int(rows), microbatches or 2 * pp))


def stretch(pp: int, rows: float, microbatches: int | None = None) -> float:
    """How much longer a stage's work takes in the pipeline than alone: ``1 / (1 - bubble)``."""
    return 1.0 / (1.0 - bubble(pp, pieces(pp, rows, microbatches)))


class _StageEnds(BaseException):
    """Raised after a stage's last block in :func:`refusal`: the stage's forward ends there, as the pipeline's does."""


def refusal(model: nn.Module, names: list[str], bounds: list[int], example: Any, dim: int = 0) -> str:
    """Why the cut at ``bounds`` cannot run, in the words each stage's rank would raise, or "". The outputs of two
    micro-batches (``dim`` the batch's) must merge as the last stage merges them; each stage after
    the first is run here as its rank runs it, on one process: the blocks before it stand in (the one just before
    it gives its real output, as the stage receives it; the earlier ones a :func:`~autodist.pp.hollow.hollow`
    one, whose every use raises), its own blocks run, and its forward ends after its last block. A planner's
    trial of a cut that one stage cannot run would leave the other stages waiting on their sends."""
    merging = _merge_refusal(model, example, dim)
    if merging:
        return merging
    modules = dict(model.named_modules())
    blocks = [modules[n] for n in names]
    outputs: list[Any] = [None] * len(blocks)
    handles = [b.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
               for i, b in enumerate(blocks)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            tree.call(model, example)
    finally:
        for h in handles:
            h.remove()
    for stage in range(1, len(bounds) - 1):
        lo, hi = bounds[stage], bounds[stage + 1]
        cut = pp_cut.Cut(names, bounds, "given")
        own = {}
        for i in range(lo):
            received = outputs[lo - 1]
            value = hollow(received, names[i], cut.stage_of(i)) if i < lo - 1 else received
            own[i] = blocks[i].__dict__.get("forward")
            blocks[i].forward = lambda *args, value=value, **kwargs: value
        last = len(bounds) - 2
        ends = blocks[hi - 1].register_forward_hook(lambda *_: _raise()) if stage < last else None
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                tree.call(model, example)
        except _StageEnds:
            pass
        except (RuntimeError, TypeError, ValueError) as err:  # as the stage's rank would raise it
            return f"stage {stage}: {str(err).splitlines()[0]}"
        finally:
            if ends is not None:
                ends.remove()
            for i, forward in own.items():
                if forward is None:
                    blocks[i].__dict__.pop("forward", None)
                else:
                    blocks[i].forward = forward
    return ""


def _raise() -> None:
    raise _StageEnds


def _merge_refusal(model: nn.Module, example: Any, dim: int) -> str:
    """Why the outputs of the example's micro-batches cannot be put together as the last stage does, or ""."""
    args, kwargs = (example if isinstance(example, tuple) else (example,)), {}
    if isinstance(example, dict):
        args, kwargs = (), example
    try:
        parts = micro.cut(args, kwargs, 2, dim)
        if len(parts.rows) < 2:
            return ""
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            outputs = [model(*a, **k) for a, k in parts.calls]
        micro.merge(outputs, parts.rows, [float(r) for r in parts.rows], dim, lambda *_: None)
    except (TypeError, ValueError) as err:
        return f"the last stage: {str(err).splitlines()[0]}"
    return ""
