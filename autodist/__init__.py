"""autodist: one call makes a single-process PyTorch training script parallel.

Example:
    >>> import autodist
    >>> model, loader = autodist.parallelize(model, loader)          # data parallel
    >>> model, loader = autodist.parallelize(model, loader, mp=2)    # 2-way model parallel x data parallel
"""
from autodist.api import parallelize
from autodist.checkpoint import load, resume, save
from autodist.gather import gather_state_dict
from autodist.grad_sync import no_sync, synchronize_model
from autodist.rewrite import Plan, explain
from autodist.runtime import World, init, rank, world_size
from autodist.structure import ModelChanged
from autodist.sync import DiLoCo, Gossip, Hierarchical, LocalSGD
from autodist.ps import EASGD, Downpour
from autodist import engine  # the training-loop helpers, as autodist.engine

__all__ = ["init", "World", "parallelize", "synchronize_model", "no_sync", "explain", "Plan", "gather_state_dict",
           "save", "load", "resume", "LocalSGD", "DiLoCo", "Gossip", "Hierarchical", "Downpour", "EASGD",
           "rank", "world_size", "engine", "ModelChanged"]
__version__ = "0.1.0"
