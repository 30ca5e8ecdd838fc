"""What ``parallelize(model, loader, ep=K)`` would do to a model, read from one forward of a global batch in this
process: which rank holds which experts of each layer, how many (token, expert) pairs of the batch each expert
gets, and the bytes a rank sends for each layer in a training step.

The example's tokens are taken as the loader deals them: the batch's rows split evenly over the ``K`` ranks of an
expert group, in order (a layer's tokens are its rows x positions, as Hugging Face flattens them). A pair whose
expert is on another rank is sent there with its hidden state, its expert's number and its weight, and its output
comes back (forward); backward sends the output's gradient there and the hidden state's and weight's back. The
pairs a rank keeps for its own experts move nothing.

Example:
    >>> plan = explain(mixtral, 2, (ids,))              # ids: one global batch, (rows, tokens)
    >>> print(plan)                                      # each layer: the experts per rank, the pairs, the bytes
    >>> plan.sent()                                      # bytes the busiest rank sends per step (forward, backward)
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autodist.ep import experts
from autodist.runtime import tree


@dataclass
class Layer:
    """One module of experts on the example: its name, its experts, ``k``, the hidden width and element size, how
    many pairs each expert got, and the pairs each rank sends to each rank (``moved[source][owner]``)."""

    name: str
    experts: int
    k: int
    width: int
    element: int
    weight_element: int
    per_expert: list[int]
    moved: list[list[int]]
    dropped: int = 0  # slots the model's router left without an expert (a capacity), as in one process

    def sent(self, rank: int) -> tuple[float, float]:
        """Bytes ``rank`` sends for this layer in a step: (forward, backward)."""
        parts = len(self.moved)
        out = sum(self.moved[rank][o] for o in range(parts) if o != rank)  # its pairs to other ranks
        back = sum(self.moved[s][rank] for s in range(parts) if s != rank)  # the others' pairs it computes
        row = self.width * self.element
        forward = out * (row + self.weight_element + 8) + back * row
        backward = out * row + back * (row + self.weight_element)
        return float(forward), float(backward)


@dataclass
class ExpertPlan:
    """The placement of every module of experts over ``parts`` ranks; ``print`` it for the table."""

    parts: int
    layers: list[Layer] = field(default_factory=list)
    cut: Any = None  # with pp, its cut into stages (a pp Cut: names, stages, stage_of; holding mp's plan with mp)
    split: Any = None  # with mp and no pp, mp's plan

    def stages(self) -> list[list[Layer]]:
        """The layers each pipeline stage holds (one list of all of them without pp): a rank sends for its own."""
        if self.cut is None:
            return [self.layers]
        held: list[list[Layer]] = [[] for _ in range(self.cut.stages)]
        for layer in self.layers:
            index = next((i for i, n in enumerate(self.cut.names) if layer.name.startswith(n + ".")), None)
            held[0 if index is None else self.cut.stage_of(index)].append(layer)
        return held

    def sent(self) -> tuple[float, float]:
        """Bytes the busiest rank sends per step over the layers it holds (with pp, its stage's): (forward,
        backward)."""
        each = [[layer.sent(r) for layer in layers] for layers in self.stages() for r in range(self.parts)]
        return max(((sum(f for f, _ in s), sum(b for _, b in s)) for s in each), key=sum, default=(0.0, 0.0))

    def __str__(self) -> str:
        if not self.layers:
            return f"ep={self.parts}: the model has no module of experts (parallelize(ep=...) refuses it)"
        first = self.layers[0]
        per = first.experts // self.parts
        holds = "; ".join(f"rank {r}: experts {r * per}-{(r + 1) * per - 1}" for r in range(self.parts))
        lines = [f"ep={self.parts}: the {first.experts} experts of each of {len(self.layers)} layers placed over "
                 f"{self.parts} ranks ({holds}); each pair (token, one of its top-{first.k} experts) goes to the "
                 f"rank holding its expert and back, dropless",
                 "  | layer | pairs per expert (this batch) | pairs leaving their rank | bytes sent (busiest rank, "
                 "forward + backward) |", "  |---|---|---|---|"]
        for layer in self.layers:
            leaving = sum(layer.moved[s][o] for s in range(self.parts) for o in range(self.parts) if s != o)
            busiest = max((sum(layer.sent(r)) for r in range(self.parts)), default=0.0)
            lines.append(f"  | {layer.name} | {', '.join(map(str, layer.per_expert))} | {leaving} of "
                         f"{sum(layer.per_expert)} | {busiest / 1e6:.3f} MB |")
        dropped = sum(layer.dropped for layer in self.layers)
        if dropped:
            lines.append(f"  the model's routers left {dropped} (token, slot) pairs of this batch without an expert "
                         f"(their capacity): they go nowhere and add nothing, as in one process")
        forward, backward = self.sent()
        staged, mine = self.cut is not None, "(of its stage's layers) "
        lines.append(f"  total: {forward / 1e6:.3f} MB forward, {backward / 1e6:.3f} MB backward by the busiest rank "
                     f"{mine if staged else ''}per step (the other parameters' gradient sync comes on top)")
        if self.cut is not None:
            lines.append("  each pipeline stage's experts placed over its own expert groups (the stages below)")
        elif self.split is not None:
            lines.append("  under mp, each model-parallel rank's experts placed over its data-parallel ranks, whole "
                         "(mp's plan below)")
        after = self.cut if self.cut is not None else self.split
        return "\n".join(lines + ([] if after is None else [str(after)]))


def explain(model: nn.Module, parts: int, example: Any) -> ExpertPlan:
    """The plan of ``parallelize(model, loader, ep=parts)`` for ``example`` (one global batch's forward arguments),
    read by running that forward once here, without gradients (no process group needed)."""
    found = experts.find(model)
    for name, module in found:
        if experts.count(module) % parts:
            raise ValueError(f"ep={parts}: {name} holds {experts.count(module)} experts, which do not split evenly "
                             f"over {parts} ranks")
    calls: dict[str, list[experts.Call]] = {}

    def watch(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls.setdefault(name, []).append(experts.check_call(name, experts.count(module),
                                                                 inspect.signature(module.forward), args, kwargs))
        return hook

    handles = [m.register_forward_pre_hook(watch(name), with_kwargs=True) for name, m in found]
    try:
        with torch.no_grad():
            tree.call(model, example)
    finally:
        for handle in handles:
            handle.remove()
    plan = ExpertPlan(parts)
    for name, module in found:
        for call in calls.get(name, []):
            plan.layers.append(_layer(name, experts.count(module), parts, call.hidden, call.index, call.weights))
    return plan


def _layer(name: str, total: int, parts: int, hidden: torch.Tensor, index: torch.Tensor,
           weights: torch.Tensor) -> Layer:
    per = total // parts
    moved = [[0] * parts for _ in range(parts)]
    for source, chunk in enumerate(torch.tensor_split(index, parts)):
        chosen = chunk.flatten()
        owners = torch.bincount(chosen[chosen >= 0] // per, minlength=parts).tolist()  # -1: a slot with none
        for owner, n in enumerate(owners):
            moved[source][owner] += int(n)
    return Layer(name, total, index.shape[1], hidden.shape[1], hidden.element_size(), weights.element_size(),
                 torch.bincount(index.flatten()[index.flatten() >= 0], minlength=total).tolist(), moved,
                 int((index < 0).sum()))
