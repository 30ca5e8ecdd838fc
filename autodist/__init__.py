"""autodist: one call makes a single-process PyTorch training script parallel.

Example:
    >>> import autodist
    >>> model, loader = autodist.parallelize(model, loader)   # then train as before
"""
from autodist.api import parallelize
from autodist.grad_sync import no_sync, synchronize_model
from autodist.runtime import World, init

__all__ = ["init", "World", "parallelize", "synchronize_model", "no_sync"]
__version__ = "0.1.0"
