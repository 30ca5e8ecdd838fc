"""The experts of a mixture-of-experts model, found in it: a module holding ``num_experts`` experts as parameters of
its own, each ``(num_experts, ...)`` (one slice an expert), and called with the tokens, each token's top-k experts
and their weights: Hugging Face's fused experts (``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts`` and the
other families written on its experts interface), which the router of each block calls as
``experts(hidden_states, top_k_index, top_k_weights)``. What the forward passes is checked at its first call
(:func:`check_call`): ``(tokens, hidden)`` states, ``(tokens, k)`` integer indices and ``(tokens, k)`` weights.

Example:
    >>> [name for name, _ in find(mixtral)]
    ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
"""
from __future__ import annotations

import inspect
import torch
from torch import nn


def count(module: nn.Module) -> int:
    """The experts ``module`` holds (0: it is not a module of experts)."""
    experts = getattr(module, "num_experts", None)
    own = list(module._parameters.values())
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2 or not own:
        return 0
    if any(p is None or p.ndim < 2 or p.shape[0] != experts for p in own):
        return 0
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return 0
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_three = len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
    return experts if takes_three else 0


def find(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` holding experts (:func:`count`), by name, in the model's order."""
    return [(name, m) for name, m in model.named_modules() if count(m)]


def check_call(name: str, experts: int, signature: inspect.Signature, args: tuple,
               kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens, their experts and weights of a call of the experts module ``name`` (its arguments put in the
    order of its forward's ``signature``, however passed), or an error naming what the call passed: ep sends each
    token to the ranks holding its experts, which it reads from these."""
    try:
        values = list(signature.bind(*args, **kwargs).arguments.values())
    except TypeError:
        values = list(args) + list(kwargs.values())
    if len(values) == 3 and all(isinstance(v, torch.Tensor) for v in values):
        hidden, index, weights = values
        if (hidden.ndim == 2 and index.ndim == 2 and weights.shape == index.shape and index.shape[0] == hidden.shape[0]
                and not index.is_floating_point() and weights.is_floating_point()):
            return hidden, index, weights
    shapes = ", ".join(f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                       for v in values)
    raise NotImplementedError(
        f"ep: {name} holds {experts} experts but was called with ({shapes}); expert parallelism takes experts "
        f"called as experts(hidden_states (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens, k)), "
        f"Hugging Face's experts interface: leave ep=1 for this model")
