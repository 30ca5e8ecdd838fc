"""What the planner takes a training step to be, on the user's model or a copy: a scalar loss from whatever
the model returns (:func:`loss_of`), the torch optimizer with the assumed number of states per parameter
(:func:`make_optimizer`), and the model, its gradients and buffers and torch's random streams put back as
they were after the planner has run steps on it (:func:`untouched`, :func:`rng_state`).

Example:
    >>> with untouched(model):
    ...     loss_of(model(x)).backward()        # measured; the model's own gradients come back after
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from autodist.planner.live import LiveBytes


@contextlib.contextmanager
def untouched(model: nn.Module, dropped: list[LiveBytes] | None = None) -> Iterator[None]:
    """The model's gradients, buffers and the random streams as they were, after whatever runs inside;
    gradients made inside are dropped as they arrive, and held (as if kept) by the trackers in ``dropped``."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = rng_state()
    for p in grads:
        p.grad = None
    sinks = [] if dropped is None else dropped

    def drop(p: torch.Tensor) -> None:
        for live in sinks:
            live.hold(p.grad.numel() * p.grad.element_size())
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in grads if p.requires_grad]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
        set_rng_state(rng)


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's random streams: the CPU's and every GPU's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def loss_of(output: Any) -> torch.Tensor:
    """A scalar from any output, for a backward through every floating output (a Hugging Face output's
    ``loss`` where it has one)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    leaves = [t for t in tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple())
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor that requires grad, so the planner "
                         "cannot run a backward through it")
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


def make_optimizer(params: Any, states: int) -> torch.optim.Optimizer:
    """The torch optimizer with ``states`` tensors per parameter: Adam (2), SGD with momentum (1), SGD (0)."""
    if states >= 2:
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if states == 1 else 0.0)


def first_rows(example: Any, n: int, dim: int) -> Any:
    """The first ``n`` rows of every tensor of the example (along ``dim``)."""
    return tree_map(lambda t: t.narrow(dim, 0, min(n, t.shape[dim])) if isinstance(t, torch.Tensor)
                    and t.dim() > dim else t, example)
