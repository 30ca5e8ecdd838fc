"""What a checkpoint needs of experts held as modules (:mod:`autodist.ep.modules`): each rank holds whole experts of
its own, under their names in the whole model, and none of the others'. So a checkpoint's names held by the other
ranks of the expert group are theirs to load (neither missing here nor unexpected), and the optimizer's state,
keyed by parameter names as a checkpoint holds it, is merged over the expert group before the writer writes it.

Example:
    >>> held_elsewhere(model)            # on rank 0 of ep=2 over 8 experts: experts 4-7's entries
    {'blocks.0.moe.experts.4.0.weight', ...}
    >>> optim = merged_optimizer_state(model, optim, list(state))   # every expert's state and name (a collective)
"""
from __future__ import annotations

from typing import Any

from torch import nn

from autodist.ep.modules import PlacedModules
from autodist.ep.place import placement_of
from autodist.runtime import plain


def _placed(model: nn.Module) -> list[PlacedModules]:
    placement = placement_of(model)
    return [] if placement is None else [p for p in placement.modules if isinstance(p, PlacedModules)]


def has_modules(model: nn.Module) -> bool:
    """Whether ``model`` holds experts as modules placed over ranks (each rank its own names of them)."""
    return bool(_placed(model))


def held_elsewhere(model: nn.Module) -> set[str]:
    """The whole model's state-dict names of the experts the other ranks of this rank's expert group hold."""
    names: set[str] = set()
    for placed in _placed(model):
        prefix = f"{placed.name}." if placed.name else ""
        for index, path in enumerate(placed.paths):
            if index // placed.per != placed.rank:
                names.update(f"{prefix}{path}.{key}" for key in placed.keys)
    return names


def merged_optimizer_state(model: nn.Module, mine: dict[str, Any], order: list[str] | None) -> dict[str, Any]:
    """``mine`` (``{"state": {name: entries}, "param_groups": [...]}`` with parameter names) with the other ranks'
    of this rank's expert group merged in: every expert's state, and each group's names, in ``order`` (the whole
    model's state-dict keys; None: as gathered). Collective over the expert group."""
    placed = _placed(model)[0]
    every = plain.all_gather_saved(mine, placed.group)  # data only: nothing received runs as code
    merged = {"state": {}, "param_groups": [dict(g, params=[]) for g in mine["param_groups"]]}
    for rank, theirs in enumerate(every):
        if len(theirs["param_groups"]) != len(merged["param_groups"]):
            raise ValueError(f"the optimizer of rank {rank} of the expert group has {len(theirs['param_groups'])} "
                             f"parameter groups and this rank's {len(mine['param_groups'])}: build it the same way "
                             f"on every rank")
        merged["state"].update(theirs["state"])
        for group, other in zip(merged["param_groups"], theirs["param_groups"]):
            group["params"] += other["params"]
    at = {name: i for i, name in enumerate(order or [])}
    for group in merged["param_groups"]:  # a name every rank holds (not an expert) once
        group["params"] = sorted(dict.fromkeys(group["params"]), key=lambda n: at.get(n, len(at)))
    return merged
