"""The experts of a mixture-of-experts model, found in it: a module with ``num_experts`` experts, called with the
tokens, each token's top-k experts and their weights, as the router of each block calls Hugging Face's experts:
``experts(hidden_states, top_k_index, top_k_weights)``. It holds them either as parameters of its own, each
``(num_experts, ...)`` (one slice an expert: ``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts`` and the
other families written on that interface; :func:`fused`), or as ``num_experts`` modules of the same tensors
(:func:`members`: Switch Transformers' ``ModuleDict`` of experts, a user's module looping over an
``nn.ModuleList``). What a call passes is checked (:func:`check_call`): ``(tokens, hidden)`` states, the
selection as ``(tokens, k)`` integer indices or a ``(tokens, k, num_experts)`` one-hot mask (a slot of zeros:
no expert, a dropped token), and ``(tokens, k)`` weights.

Example:
    >>> [name for name, _ in find(mixtral)]
    ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn


def count(module: nn.Module) -> int:
    """The experts ``module`` holds (0: it is not a module of experts)."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2 or not _takes_three(module):
        return 0
    own = list(module._parameters.values())
    if own and all(p is not None and p.ndim >= 2 and p.shape[0] == experts for p in own):
        return experts
    return experts if not own and members(module) else 0


def fused(module: nn.Module) -> bool:
    """Whether ``module`` (a module of experts) holds them as ``(num_experts, ...)`` parameters of its own; if not,
    as ``num_experts`` modules (:func:`members`)."""
    return bool(module._parameters)


def members(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The expert modules of a container of experts, each with its path under ``module``, in expert order: the
    module's own ``num_experts`` children when it is an ``nn.ModuleList``/``nn.ModuleDict`` (Switch Transformers'
    experts), or those of its one child that is; each an expert of the same tensors (names and shapes) holding
    some. Empty: ``module`` is not such a container."""
    experts = getattr(module, "num_experts", None)
    containers = (nn.ModuleList, nn.ModuleDict)
    if isinstance(module, containers) and len(module) == experts:
        found = list(module._modules.items())
    else:
        inner = [(n, c) for n, c in module._modules.items() if isinstance(c, containers) and len(c) == experts]
        if len(inner) != 1:
            return []
        found = [(f"{inner[0][0]}.{key}", m) for key, m in inner[0][1]._modules.items()]
    shapes = [_tensors(m) for _, m in found]
    if not shapes or not shapes[0] or any(s != shapes[0] for s in shapes):
        return []
    return found


def _tensors(module: nn.Module | None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    if module is None:
        return []
    return [(n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(), *module.named_buffers()]]


def _takes_three(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def find(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` holding experts (:func:`count`), by name, in the model's order."""
    return [(name, m) for name, m in model.named_modules() if count(m)]


@dataclass
class Call:
    """One call of a module of experts, read: the tokens' hidden states ``(tokens, hidden)``, each token's ``k``
    experts ``(tokens, k)`` (-1: the slot chose none, as a capacity-limited router's dropped token) and their
    weights ``(tokens, k)``; ``mask``: the dtype of the selection where the call passed it as a ``(tokens, k,
    experts)`` one-hot mask (Switch Transformers), None where it passed indices."""

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    mask: torch.dtype | None = None

    def selection(self, chosen: torch.Tensor, experts: int) -> torch.Tensor:
        """``chosen`` (one expert a row) in the format this call passed its selection in, one slot a row."""
        if self.mask is None:
            return chosen[:, None].to(self.index.dtype)
        return nn.functional.one_hot(chosen, experts)[:, None, :].to(self.mask)


def check_call(name: str, experts: int, signature: inspect.Signature, args: tuple, kwargs: dict) -> Call:
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
            return Call(hidden, index, weights)
        if (hidden.ndim == 2 and index.ndim == 3 and index.shape[2] == experts and index.shape[:2] == weights.shape
                and index.shape[0] == hidden.shape[0] and not index.is_floating_point()
                and weights.is_floating_point()):
            hits = (index != 0).sum(-1)
            if bool((hits > 1).any()) or bool(((index != 0) & (index != 1)).any()):
                raise NotImplementedError(
                    f"ep: {name} was called with a (tokens, k, {experts}) selection whose slots are not one-hot "
                    f"(a slot with several experts, or a weight in the mask): ep reads each slot as one expert or "
                    f"none; leave ep=1 for this model")
            index = torch.where(hits > 0, index.argmax(-1), -1)
            return Call(hidden, index, weights, values[1].dtype)
    shapes = ", ".join(f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                       for v in values)
    raise NotImplementedError(
        f"ep: {name} holds {experts} experts but was called with ({shapes}); expert parallelism takes experts "
        f"called as experts(hidden_states (tokens, hidden), top_k_index (tokens, k) or a one-hot (tokens, k, "
        f"experts) mask, top_k_weights (tokens, k)), Hugging Face's experts interface: leave ep=1 for this model")
