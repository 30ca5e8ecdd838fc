"""Catch an optimizer built before parallelize over parameters that parallelize replaced."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(parameter) -> (weak reference, name); tensors compare elementwise, so they cannot be dict keys themselves
_retired: dict[int, tuple[weakref.ref, str]] = {}
_hook_installed = False


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _retired:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref, name = _retired.get(id(p), (None, ""))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {name!r} of the model as it was before "
                    f"autodist.parallelize, which replaced it by its model-parallel shard; this step would "
                    f"update a tensor the model no longer uses. Build the optimizer after parallelize.")


def retire(named: list[tuple[torch.Tensor, str]]) -> None:
    """Remember parameters that no longer belong to the model; optimizers holding them will refuse to step."""
    global _hook_installed
    for p, name in named:
        _retired[id(p)] = (weakref.ref(p, lambda _, key=id(p): _retired.pop(key, None)), name)
    if named and not _hook_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _hook_installed = True
