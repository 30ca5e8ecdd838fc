"""autodist: one call makes a single-process PyTorch training script parallel.

Example:
    >>> import autodist
    >>> model, loader = autodist.parallelize(model, loader)          # data parallel
    >>> model, loader = autodist.parallelize(model, loader, mp=2)    # 2-way model parallel x data parallel

The package is one folder per subsystem (docs/architecture.md has the map and the
layering rule); this file and :mod:`autodist.api` are its public face.
"""
import sys

from autodist.api import explain, parallelize, plan
from autodist.dp.grad_sync import no_sync, synchronize_model
from autodist.dp.structure import ModelChanged
from autodist.mp.gather import gather_state_dict
from autodist.mp.rewrite import SplitPlan
from autodist.planner.plan import Auto, ParallelPlan
from autodist.ps import EASGD, Downpour
from autodist.runtime import comm
from autodist.runtime.world import World, init, rank, world_size
from autodist.sharded.parameters import full_parameters
from autodist.sync import DiLoCo, Gossip, Hierarchical, LocalSGD
from autodist.train import checkpoint, engine
from autodist.train.checkpoint import load, resume, save
from autodist.train.memory import memory

# The public modules keep the short names they always had (as os.path is os's): autodist.engine (the training-loop
# helpers), autodist.comm (collectives over communicators), autodist.checkpoint (save / load and CheckpointError).
for _public in (engine, comm, checkpoint):
    sys.modules[f"{__name__}.{_public.__name__.rsplit('.', 1)[1]}"] = _public
del _public

__all__ = ["init", "World", "parallelize", "synchronize_model", "no_sync", "explain", "SplitPlan", "gather_state_dict",
           "save", "load", "resume", "LocalSGD", "DiLoCo", "Gossip", "Hierarchical", "Downpour", "EASGD",
           "rank", "world_size", "engine", "ModelChanged", "memory", "full_parameters", "plan", "Auto",
           "ParallelPlan"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``autodist.Plan``, the model-parallel split's old name (beside ``autodist.plan()``, the layout search, it
    read as the same thing): still there, with a DeprecationWarning."""
    if name == "Plan":
        import warnings

        warnings.warn("autodist.Plan is now autodist.SplitPlan (what explain(model, mp=K) returns: how each layer "
                      "is split); autodist.plan() and autodist.ParallelPlan are the layout search", DeprecationWarning,
                      stacklevel=2)
        return SplitPlan
    raise AttributeError(f"module 'autodist' has no attribute {name!r}")
