"""One data-parallel wrapper per model: a wrapped model is refused, and a parallelized one run inside a wrapper
fails at its first forward.

DDP, FSDP, DataParallel, DeepSpeed's engine and the frameworks that use them (Accelerate's ``prepare``, Hugging
Face's Trainer, Lightning's ddp strategies) synchronize gradients themselves. Around a model ``parallelize``
returned, every step would synchronize twice, and the framework splits the data again: the same silent halving
of the data whichever wrapped first. Wrappers are known by class name along the class's bases, so that none
of them is imported (FSDP2's ``fully_shard`` makes the module's class an ``FSDPModule`` subclass); the check at
forward looks for a wrapper's method among the forward's callers, reading locals only in the wrappers' files.

Example:
    >>> refuse_wrapped(torch.nn.parallel.DistributedDataParallel(model))   # TypeError naming .module
    >>> watch(model)         # parallelize does this; DDP(model)(x) then raises at the forward
"""
from __future__ import annotations

import torch
from torch import nn

from autodist.runtime.callers import calling_class, calling_objects, class_named

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule", "DeepSpeedEngine")
_WRAPPER_FILES = ("torch/nn/parallel/", "torch/distributed/fsdp/", "deepspeed/")
_CALLERS = 12  # frames from the forward pre-hook up to a wrapper's (under Lightning's: its module wrapper's too)
_GUIDE = "docs/frameworks.md has the route for Hugging Face Trainer, Accelerate and Lightning"


def _named(kind: str | None) -> str | None:
    return "fully_shard (FSDPModule)" if kind == "FSDPModule" else kind


def refuse_wrapped(model: nn.Module) -> None:
    """Raise if ``model`` or one of its submodules is already wrapped by a data-parallel wrapper."""
    for name, module in model.named_modules():
        kind = _named(class_named(module, _WRAPPERS))
        if kind is not None:
            where = "the model" if not name else f"the model's submodule {name!r}"
            inner = "the plain module" if "FSDPModule" in kind else "its .module"
            raise TypeError(
                f"{where} is wrapped in {kind}, which synchronizes gradients itself: parallelize the unwrapped "
                f"model ({inner}) and do not wrap what parallelize returns; {_GUIDE}")


def _refuse_wrapper(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # frames are Python state dynamo does not trace; the eager call checked
        return
    kind = _named(class_named(module, _WRAPPERS) or calling_class(_WRAPPERS, _CALLERS, _WRAPPER_FILES))
    if kind is not None:
        raise RuntimeError(
            f"the model parallelize returned runs inside {kind}: autodist already synchronizes its gradients and "
            f"splits its data, so every step would synchronize twice and see half the data; use the model "
            f"parallelize returns without wrapping it (no DDP, FSDP or Accelerate's prepare(model)); {_GUIDE}")


def refuse_inside_lightning(model: nn.Module) -> None:
    """Raise where ``parallelize`` is called from a LightningModule attached to a Trainer whose strategy is not
    autodist's: Lightning's ddp strategies wrap the model in DDP and split the data again, and its single-device
    strategy counts every process as global rank 0 (logging, checkpoints and ``rank_zero_only`` code run on
    every rank, writing the same files). Called only where the world has more than one rank."""
    for owner in (model, *calling_objects()):
        if class_named(owner, ("LightningModule",)) is None:
            continue
        trainer = getattr(owner, "_trainer", None)
        strategy = type(getattr(trainer, "strategy", None)).__name__
        if trainer is not None and strategy != "AutodistStrategy":
            does = "counts every process as global rank 0" if strategy.startswith("SingleDevice") else \
                "wraps the model and splits the data itself"
            raise RuntimeError(
                f"parallelize is called inside a Lightning Trainer whose strategy, {strategy}, {does}: give the "
                f"Trainer autodist's strategy instead, Trainer(strategy=autodist.lightning.AutodistStrategy(...)), "
                f"and do not call parallelize yourself; {_GUIDE}")


def watch(model: nn.Module) -> None:
    """Make a forward of ``model`` raise when a data-parallel wrapper runs it (see the module docstring)."""
    model.register_forward_pre_hook(_refuse_wrapper)
