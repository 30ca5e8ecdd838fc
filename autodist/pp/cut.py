"""Where the stages begin: the model's blocks (:func:`autodist.sharded.blocks.find`: its transformer or ResNet
blocks, or the modules ``blocks=`` names) dealt out to ``pp`` stages in order, each stage a run of consecutive
blocks.

``stages=`` says it by hand: a list of ``pp`` counts (how many blocks each stage takes, in order) or of ``pp`` lists
of module names (each stage's blocks: the model's blocks are then exactly these). Otherwise rank 0 times each
block's forward and backward on a sample of the data (the fastest of three runs after a warm-up) and counts the
bytes each holds (its parameters, their gradients and an Adam-like optimizer's two states, and the activations it
saves for backward), and the cut is the one whose fullest stage is least full, time and memory each taken as a share
of the whole (the code after the last block, the head, counts to the last stage). Without a sample, parameters alone
decide. Every rank takes rank 0's cut.

Example:
    >>> cut = decide(nanogpt, 2, None, None, example=(idx,))
    >>> cut.stage_names(0)
    ['transformer.h.0', 'transformer.h.1']
    >>> print(cut)          # what autodist.explain(model, pp=2) prints
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from autodist.runtime import plain
from autodist.runtime.tree import tensor_leaves
from autodist.sharded import blocks as sharded_blocks

Stages = Sequence[int] | Sequence[Sequence[str]] | None
_TIMED = 3  # timed runs after the warm-up; each block's fastest is kept (a pause of the machine only adds time)


@dataclass
class Cut:
    """The blocks and where each stage's run of them begins (``bounds[s]`` to ``bounds[s + 1]``)."""

    names: list[str]
    bounds: list[int]
    how: str  # "given", "measured" or "parameters"
    seconds: list[float] = field(default_factory=list)  # per block, measured (forward and backward)
    bytes: list[int] = field(default_factory=list)  # per block
    outputs: list[float] = field(default_factory=list)  # per block, bytes of its output per sample (measured)
    mp_plan: Any = None  # explain with mp > 1 too: the model-parallel plan, printed below the stages

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_names(self, stage: int) -> list[str]:
        return self.names[self.bounds[stage]:self.bounds[stage + 1]]

    def stage_of(self, index: int) -> int:
        return next(s for s in range(self.stages) if self.bounds[s] <= index < self.bounds[s + 1])

    def describe(self) -> list[str]:
        """One line per stage: its blocks and, where measured, its share of the time and of the bytes."""
        lines = []
        for s in range(self.stages):
            names = self.stage_names(s)
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            line = f"stage {s}: {len(names)} block{'s' if len(names) > 1 else ''} ({shown})"
            lo, hi = self.bounds[s], self.bounds[s + 1]
            if self.seconds and sum(self.seconds):
                line += f", {100 * sum(self.seconds[lo:hi]) / sum(self.seconds):.0f}% of the blocks' time"
            if self.bytes and sum(self.bytes):
                line += f", {100 * sum(self.bytes[lo:hi]) / sum(self.bytes):.0f}% of their bytes"
            if self.outputs and s < self.stages - 1:
                line += f"; sends {self.outputs[hi - 1]:,.0f} bytes a sample to stage {s + 1} (and gets its gradient)"
            lines.append(line)
        return lines

    def __str__(self) -> str:
        why = {"given": "as stages= gives them", "measured": "balanced by the time and bytes measured per block on "
               "a sample", "parameters": "balanced by the parameters' bytes (no sample to measure on)"}[self.how]
        lines = [f"pp={self.stages}: {len(self.names)} blocks in {self.stages} stages, {why}; every stage also holds "
                 f"the root (the code around the blocks: embeddings, head) and runs the code before the blocks",
                 *self.describe()]
        return "\n".join(lines + ([str(self.mp_plan)] if self.mp_plan is not None else []))


def _no_blocks(model: nn.Module, pp: int) -> ValueError:
    return ValueError(f"pp={pp} cuts the model between its blocks, and {sharded_blocks.none_found(model, 'autodist')}"
                      f"; or give each stage's modules with stages=[[...], [...]]")


def _given(model: nn.Module, pp: int, stages: Any, blocks: sharded_blocks.Choice) -> Cut:
    if not isinstance(stages, (list, tuple)) or len(stages) != pp:
        raise ValueError(f"stages= gives each of the pp={pp} stages its blocks: a list of {pp} counts (blocks per "
                         f"stage, in order) or of {pp} lists of module names; got {stages!r:.200}")
    if all(isinstance(s, (list, tuple)) for s in stages):
        if blocks is not None:
            raise ValueError("stages=[[names], ...] names the blocks itself: drop blocks=")
        names = [n for s in stages for n in s]
        found = [n for n, _ in sharded_blocks.find(model, names)]
        if found != names:
            raise ValueError(f"stages= names modules out of the model's order or without parameters: they run "
                             f"{found}, and the stages list {names}; list each stage's modules in the order the "
                             f"forward calls them")
        bounds = [0]
        for s in stages:
            if not s:
                raise ValueError(f"stages= gives stage {len(bounds) - 1} no module: every stage needs one")
            bounds.append(bounds[-1] + len(s))
        return Cut(names, bounds, "given")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in stages):
        raise ValueError(f"stages= counts must be positive ints (blocks per stage), got {list(stages)}")
    names = [n for n, _ in sharded_blocks.find(model, blocks)]
    if not names:
        raise _no_blocks(model, pp)
    if sum(stages) != len(names):
        raise ValueError(f"stages={list(stages)} deals out {sum(stages)} blocks, and {type(model).__name__} has "
                         f"{len(names)} ({names[0]} .. {names[-1]}): the counts must add up to {len(names)}")
    bounds = [0]
    for s in stages:
        bounds.append(bounds[-1] + s)
    return Cut(names, bounds, "given")


def balance(seconds: list[float], sizes: list[int], stages: int, tail: float = 0.0) -> list[int]:
    """The bounds of the cut into ``stages`` runs whose fullest run (the larger of its time share and its byte
    share; ``tail`` seconds added to the last run) is least full; the earliest such cut."""
    n = len(seconds)
    total_t = sum(seconds) + tail or 1.0
    total_b = sum(sizes) or 1

    def load(lo: int, hi: int, last: bool) -> float:
        return max((sum(seconds[lo:hi]) + (tail if last else 0.0)) / total_t, sum(sizes[lo:hi]) / total_b)

    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, left: int) -> tuple[float, list[int]]:
        if (start, left) in best:
            return best[start, left]
        if left == 1:
            result = (load(start, n, True), [start, n])
        else:
            result = (float("inf"), [])
            for end in range(start + 1, n - left + 2):
                rest, bounds = solve(end, left - 1)
                worst = max(load(start, end, False), rest)
                if worst < result[0] - 1e-12:
                    result = (worst, [start, *bounds])
        best[start, left] = result
        return result

    return solve(0, stages)[1]


def _call(model: nn.Module, example: Any) -> Any:
    if isinstance(example, dict):
        return model(**example)
    return model(*example) if isinstance(example, tuple) else model(example)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next((t for _, t in tensor_leaves(obj) if t.requires_grad), None)


def measure(model: nn.Module, names: list[str], example: Any) -> tuple[list[float], list[int], float, list[int]]:
    """Per block: seconds of one forward and backward on ``example`` (the fastest of a few runs) and bytes held
    (see the module docstring); the seconds after the last block (the head); per block, the bytes of its output.
    The model's gradients and RNG are left as they were."""
    modules = dict(model.named_modules())
    blocks = [modules[n] for n in names]
    params = [sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in b.parameters())
              for b in blocks]
    saved = [0] * len(blocks)
    sent = [0] * len(blocks)
    forward = [0.0] * len(blocks)
    grads_at = [0.0] * (len(blocks) + 1)  # when the gradient reached block i's output (i), and its input (-1)
    state = {"block": None, "start": 0.0, "end": 0.0}
    handles = []

    def pre(i: int, module: nn.Module, args: Any) -> None:
        state["block"], state["start"] = i, time.perf_counter()
        t = _first_tensor(args)
        if i == 0 and t is not None:
            t.register_hook(lambda g: grads_at.__setitem__(len(blocks), time.perf_counter()))

    def post(i: int, module: nn.Module, args: Any, out: Any) -> None:
        forward[i] = time.perf_counter() - state["start"]
        state["block"], state["end"] = None, time.perf_counter()
        sent[i] = sum(x.numel() * x.element_size() for _, x in tensor_leaves(out))
        t = _first_tensor(out)
        if t is not None:
            t.register_hook(lambda g: grads_at.__setitem__(i, time.perf_counter()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if state["block"] is not None:
            saved[state["block"]] += t.numel() * t.element_size()
        return t

    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(lambda m, a, i=i: pre(i, m, a)))
        handles.append(b.register_forward_hook(lambda m, a, o, i=i: post(i, m, a, o)))
    kept = {p: p.grad for p in model.parameters()}
    best_f, best_b, head = [float("inf")] * len(blocks), [float("inf")] * len(blocks), float("inf")
    try:
        with torch.random.fork_rng(devices=[]):
            for run in range(1 + _TIMED):  # the first warms up
                saved[:] = [0] * len(blocks)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = _call(model, example)
                after = time.perf_counter() - state["end"]
                loss = sum(t.float().mean() for _, t in _floating(out))
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
                else:  # no backward to time: it is taken as twice the forward
                    grads_at[:] = [0.0] * len(grads_at)
                if run == 0:
                    continue
                # backward of block i ends when the gradient reaches its input: the output of block i - 1 (the
                # model's input to block 0, where it needs one)
                backward = [max(0.0, (grads_at[i - 1] if i > 0 else grads_at[len(blocks)]) - grads_at[i])
                            for i in range(len(blocks))]
                best_f = [min(a, b) for a, b in zip(best_f, forward)]
                best_b = [min(a, b) for a, b in zip(best_b, backward)]
                head = min(head, after)
    finally:
        for h in handles:
            h.remove()
        for p, g in kept.items():
            p.grad = g
    seconds = [f + 2 * f if b == 0.0 else f + b for f, b in zip(best_f, best_b)]
    return seconds, [p + s for p, s in zip(params, saved)], head, sent


def _floating(out: Any) -> list[tuple[str, torch.Tensor]]:
    return [(p, t) for p, t in tensor_leaves(out) if t.is_floating_point() and t.requires_grad]


def _rows(example: Any) -> int:
    first = next((t for _, t in tensor_leaves(example) if t.dim() > 0), None)
    return first.shape[0] if first is not None else 1


def decide(model: nn.Module, pp: int, stages: Stages, blocks: sharded_blocks.Choice, example: Any) -> Cut:
    """The cut of ``model`` into ``pp`` stages (see the module docstring), decided here: no other rank is asked."""
    if stages is not None:
        return _given(model, pp, stages, blocks)
    names = [n for n, _ in sharded_blocks.find(model, blocks)]
    if not names:
        raise _no_blocks(model, pp)
    if pp > len(names):
        raise ValueError(f"pp={pp} stages need at least {pp} blocks, and {type(model).__name__} has {len(names)} "
                         f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): use pp<={len(names)}, or "
                         f"name finer blocks with blocks=[...]")
    modules = dict(model.named_modules())
    sizes = [sum(p.numel() * p.element_size() for p in modules[n].parameters()) for n in names]
    if example is None:
        return Cut(names, balance([0.0] * len(names), sizes, pp), "parameters", [], sizes)
    seconds, sizes, head, sent = measure(model, names, example)
    rows = _rows(example)
    return Cut(names, balance(seconds, sizes, pp, head), "measured", seconds, sizes, [b / rows for b in sent])


def choose(model: nn.Module, pp: int, stages: Stages, blocks: sharded_blocks.Choice, example: Any, rank: int,
           group: Any = None) -> Cut:
    """The cut of ``model`` into ``pp`` stages (see the module docstring); a collective over ``group`` (every
    rank takes rank 0's)."""
    if stages is not None:
        return _given(model, pp, stages, blocks)
    mine = decide(model, pp, stages, blocks, example if rank == 0 else None)  # every rank checks the blocks
    decided = (mine.bounds, mine.how, mine.seconds, mine.bytes, mine.outputs) if rank == 0 else None
    bounds, how, seconds, sizes, outputs = plain.broadcast(decided, src=0, group=group)
    return Cut(mine.names, list(bounds), how, list(seconds), list(sizes), list(outputs))
