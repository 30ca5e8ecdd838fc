"""autodist: one call makes a single-process PyTorch training script parallel.

Example:
    >>> import autodist
    >>> model, loader = autodist.parallelize(model, loader)          # data parallel
    >>> model, loader = autodist.parallelize(model, loader, mp=2)    # 2-way model parallel x data parallel

The package is one folder per subsystem (docs/architecture.md has the map and the
layering rule); this file and :mod:`autodist.api` are its public face. Each public name
is imported from its module at its first use, so that ``import autodist`` alone loads
nothing of torch: the process that supervises ``autodist run`` uses none of them and
starts in a few milliseconds. ``autodist.engine``, ``autodist.comm`` and
``autodist.checkpoint`` are the modules ``autodist.train.engine``,
``autodist.runtime.comm`` and ``autodist.train.checkpoint`` under the short names they
always had (``import autodist.engine`` too, which a finder on ``sys.meta_path`` answers
with the module of the long name), imported at their first use alike.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ imports, for type checkers and readers (and the layering test)
    from autodist.api import explain, parallelize, plan
    from autodist.dp.check import Check
    from autodist.dp.grad_sync import no_sync, synchronize_model
    from autodist.dp.structure import ModelChanged
    from autodist.dp.whole_batch import whole_batch
    from autodist.mp.gather import gather_state_dict
    from autodist.mp.rewrite import SplitPlan
    from autodist.planner.plan import Auto, ParallelPlan
    from autodist.planner.target import Target
    from autodist.ps import EASGD, Downpour
    from autodist.runtime import comm
    from autodist.runtime.layout import Layout
    from autodist.runtime.world import World, init, rank, world_size
    from autodist.sharded.parameters import full_parameters
    from autodist.sync import DiLoCo, Gossip, Hierarchical, LocalSGD
    from autodist.train import checkpoint, engine
    from autodist.train.checkpoint import load, resume, save
    from autodist.train.memory import memory

_WHERE = {  # public name -> the module it lives in
    **dict.fromkeys(("explain", "parallelize", "plan"), "autodist.api"),
    **dict.fromkeys(("no_sync", "synchronize_model"), "autodist.dp.grad_sync"),
    "ModelChanged": "autodist.dp.structure", "whole_batch": "autodist.dp.whole_batch", "Check": "autodist.dp.check",
    "gather_state_dict": "autodist.mp.gather",
    "SplitPlan": "autodist.mp.rewrite", "Auto": "autodist.planner.plan", "ParallelPlan": "autodist.planner.plan",
    "Target": "autodist.planner.target",
    "EASGD": "autodist.ps", "Downpour": "autodist.ps", "Layout": "autodist.runtime.layout",
    **dict.fromkeys(("World", "init", "rank", "world_size"), "autodist.runtime.world"),
    "full_parameters": "autodist.sharded.parameters",
    **dict.fromkeys(("DiLoCo", "Gossip", "Hierarchical", "LocalSGD"), "autodist.sync"),
    **dict.fromkeys(("load", "resume", "save"), "autodist.train.checkpoint"),
    "memory": "autodist.train.memory",
}
_MODULES = {"engine": "autodist.train.engine", "comm": "autodist.runtime.comm", "checkpoint": "autodist.train.checkpoint"}

__all__ = ["init", "World", "parallelize", "synchronize_model", "no_sync", "explain", "SplitPlan", "gather_state_dict",
           "save", "load", "resume", "LocalSGD", "DiLoCo", "Gossip", "Hierarchical", "Downpour", "EASGD",
           "rank", "world_size", "engine", "ModelChanged", "memory", "full_parameters", "plan", "Auto",
           "ParallelPlan", "Layout", "Target", "whole_batch", "Check"]
__version__ = "0.1.0"


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import autodist.engine`` (``comm``, ``checkpoint``): the module of the long name, imported then, under
    both names (one module object; its own ``__spec__`` kept)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        short = fullname.removeprefix(f"{__name__}.")
        if fullname == short or short not in _MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: object) -> object:
        module = importlib.import_module(_MODULES[spec.name.rsplit(".", 1)[1]])  # type: ignore[attr-defined]
        self.spec = module.__spec__  # the import system sets the short name's spec on it next
        return module

    def exec_module(self, module: object) -> None:
        module.__spec__ = self.spec  # type: ignore[attr-defined]


sys.meta_path.append(_ShortNames())


def __getattr__(name: str) -> object:
    """A public name, imported from its module at its first use (then kept here); a subsystem
    (``autodist.planner``); ``autodist.Plan``, the model-parallel split's old name (beside ``autodist.plan()``,
    the layout search, it read as the same thing), with a DeprecationWarning."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "Plan":
        import warnings

        warnings.warn("autodist.Plan is now autodist.SplitPlan (what explain(model, mp=K) returns: how each layer "
                      "is split); autodist.plan() and autodist.ParallelPlan are the layout search", DeprecationWarning,
                      stacklevel=2)
        return __getattr__("SplitPlan")
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'autodist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
