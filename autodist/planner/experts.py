"""What ``ep=K`` makes of a mixture of experts, for the planner: the bytes of its experts (each rank of an expert
group holds ``1/K`` of every layer's, never sharded further: their gradients stay out of the buckets) and, for each
degree, the bytes the busiest rank of a group sends per row of its own in a step, forward and backward
(:func:`autodist.ep.explain.explain` read on one forward of ``K`` ranks' rows here: the tokens as the router sends
them). A layer's exchange is 4 all-to-alls forward (the counts, the hidden states, the experts' numbers and
weights, the outputs back) and 3 backward.

Example:
    >>> experts = read(mixtral, example, rows=8, degrees=[2, 4], batch_dim=0)
    >>> experts.param_bytes, experts.sent[2]       # the experts' bytes; bytes a rank sends per row at ep=2
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from autodist.ep import experts as ep_experts
from autodist.ep import explain as ep_explain
from autodist.planner.live import nbytes
from autodist.planner.step import first_rows, untouched

EXCHANGES = 7  # all-to-alls a layer of experts makes a step: 4 forward, 3 backward


@dataclass
class Experts:
    """The experts' parameter bytes (the trainable part), their layers, and by degree the bytes the busiest rank
    sends per row of its own (forward, backward) or why that degree cannot be made."""

    param_bytes: float = 0.0
    trainable_bytes: float = 0.0
    layers: int = 0
    sent: dict[int, tuple[float, float]] = field(default_factory=dict)
    impossible: dict[int, str] = field(default_factory=dict)

    def why_not(self, ep: int) -> str:
        """Why ``ep`` cannot be made ("" where it can)."""
        if not self.layers:
            return f"ep={ep}: the model has no module of experts to place (docs/experts.md names the ones it finds)"
        return self.impossible.get(ep, "")


@contextlib.contextmanager
def as_placed(model: nn.Module, ep: int) -> Iterator[None]:
    """While inside, each module of experts held as ``(num_experts, ...)`` parameters computes as a rank of
    ``ep=K`` does on an even routing: its first ``1/K`` of the experts (a slice of each parameter, a gradient of its
    own), run on as many (token, expert) pairs as its tokens make, one pair a row, the outputs added to each
    token's zeros (:func:`autodist.ep.exchange.dispatch` without the exchange). What autograd keeps and makes there
    is a rank's, which one process's loop over every expert is not (Hugging Face's eager experts make a gradient
    the size of the whole ``(num_experts, ...)`` tensor for each expert's slice). Experts held as modules compute
    as in one process."""
    restore = []
    for name, module in ep_experts.find(model):
        if not ep_experts.fused(module) or ep_experts.count(module) % ep:
            continue
        total, per = ep_experts.count(module), ep_experts.count(module) // ep
        whole = {n: p for n, p in module._parameters.items() if p is not None}
        local, signature = module.forward, inspect.signature(module.forward)

        def forward(*args: Any, _name: str = name, _total: int = total, _per: int = per, _local: Any = local,
                    _signature: inspect.Signature = signature, **kwargs: Any) -> torch.Tensor:
            call = ep_experts.check_call(_name, _total, _signature, args, kwargs)
            flat = call.index.reshape(-1)
            kept = flat >= 0
            token = torch.arange(call.index.numel(), device=flat.device)[kept] // call.index.shape[1]
            made = _local(call.hidden[token], call.selection(flat[kept] % _per, _per),
                          call.weights.reshape(-1)[kept][:, None])
            return torch.zeros_like(call.hidden).index_add(0, token, made.to(call.hidden.dtype))

        for n, p in whole.items():
            module._parameters[n] = nn.Parameter(p.detach()[:per], requires_grad=p.requires_grad)
        restore.append((module, whole, total, module.__dict__.get("forward")))
        module.num_experts, module.forward = per, forward
    try:
        yield
    finally:
        for module, whole, total, own in restore:
            module._parameters.update(whole)
            module.num_experts = total
            module.__dict__.pop("forward", None)
            if own is not None:
                module.forward = own


def read(model: nn.Module, example: Any, rows: int, degrees: list[int], batch_dim: int = 0) -> Experts:
    """The model's experts and, for each of ``degrees``, its exchange on ``K x rows`` rows of ``example`` (``rows`` a
    rank, as the loader deals them)."""
    found = ep_experts.find(model)
    if not found:
        return Experts()
    params = [p for _, module in found for p in module.parameters()]
    result = Experts(nbytes(params), nbytes(p for p in params if p.requires_grad))
    with untouched(model):
        for k in degrees:
            try:
                plan = ep_explain.explain(model, k, first_rows(example, k * rows, batch_dim))
            except (ValueError, RuntimeError, NotImplementedError, TypeError) as err:
                result.impossible[k] = str(err).splitlines()[0] if str(err) else type(err).__name__
                continue
            forward, backward = plan.sent()
            result.sent[k] = (forward / rows, backward / rows)
            result.layers = len(plan.layers)
    if not result.layers and result.impossible:
        result.layers = len(found)
    return result
