"""``parallelize``: validate -> init -> lay out ranks -> replicate -> hooks -> shard."""
from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from autodist import data as data_mod
from autodist.grad_sync import GradSync, attach, state_of
from autodist.mesh import ParallelDims
from autodist.replicate import broadcast_state, check_same_model
from autodist.runtime import init, log


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"the model ({type(model).__name__}) has no trainable parameters (none with "
                         f"requires_grad=True), so there is nothing to train in parallel")
    if state_of(model) is not None:
        raise RuntimeError("this model is already parallelized; call autodist.parallelize once per model")


def _check_options(sync: str, mp: int, bucket_mb: float, first_bucket_mb: float) -> None:
    if sync not in ("backward", "manual"):
        raise ValueError(f"sync must be 'backward' (synchronize during backward) or 'manual' "
                         f"(call autodist.synchronize_model yourself), got {sync!r}")
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ValueError(f"mp must be a positive int, got {mp!r}")
    if mp > 1:
        raise NotImplementedError("model parallelism (mp > 1) is not available in this version of autodist; "
                                  "use mp=1 (data parallel)")
    if not (bucket_mb > 0 and first_bucket_mb > 0):
        raise ValueError(f"bucket sizes must be positive, got bucket_mb={bucket_mb}, "
                         f"first_bucket_mb={first_bucket_mb}")


def _shared_seed(group: dist.ProcessGroup | None) -> int:
    """One seed drawn from rank 0's global RNG, the same on every rank."""
    seed = torch.tensor([int(torch.empty((), dtype=torch.int64).random_().item())])
    dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def parallelize(
    model: nn.Module,
    data: data_mod.DataLike = None,
    *,
    mp: int = 1,
    sync: Literal["backward", "manual"] = "backward",
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    sync_buffers: bool = True,
    backend: str | None = None,
) -> tuple[nn.Module, data_mod.DataLike]:
    """Make a single-process model and its data data-parallel over all ranks.

    Every rank checks it holds the same model as rank 0 and takes rank 0's
    parameters and buffers; backward hooks then all-reduce gradients in
    buckets, overlapped with the rest of backward, so that after
    ``loss.backward()`` every rank holds the gradient of the *global* batch,
    as one process would.

    Args:
        model: the model, changed in place and returned.
        data: a tensor or numpy array, a tuple/list of them (same first
            dimension), a map-style Dataset or a DataLoader; None for no data.
        mp: model-parallel degree; only 1 (pure data parallel) so far.
        sync: "backward" installs the hooks; "manual" installs none and you
            call ``autodist.synchronize_model(model)`` yourself.
        bucket_mb / first_bucket_mb: bucket sizes for the gradient all-reduce.
        sync_buffers: average floating-point buffers (BatchNorm running stats)
            over ranks, weighted by samples, at every gradient sync.
        backend: force "gloo" or "nccl" (default: chosen by ``autodist.init``).

    Returns:
        ``(model, shard)``: the model, and this rank's shard of ``data`` of the
        same kind (a DataLoader comes back as a DataLoader yielding this rank's
        slice of each global batch).

    Example:
        >>> model, loader = autodist.parallelize(model, loader)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()   # gradients synchronized here
        ...     optimizer.step()

    Note:
        The gradient of the global batch is formed by weighting each rank by
        the samples its forward passes saw (the first dimension of the first
        tensor argument), so uneven shards stay exact for a loss that is a mean
        over the batch. BatchNorm normalises with each rank's local batch
        statistics, as in DDP. Build the optimizer after parallelize.
    """
    _check_model(model)
    _check_options(sync, mp, bucket_mb, first_bucket_mb)
    world = init(backend)
    dims = ParallelDims.for_world(world.size, mp)
    if world.size == 1:
        data_mod.check(data, 1)
        return model, data
    group = None  # mp == 1: the data-parallel group is the whole world
    shard = None if data is None else data_mod.shard(data, dims.dp_rank(world.rank), dims.dp,
                                                     shared_seed=lambda: _shared_seed(group))
    if world.backend == "nccl":
        model.to(world.device)
    check_same_model(model, group)
    broadcast_state(model, src=0, group=group)
    attach(model, GradSync(model, group, hooks=(sync == "backward"), first_bucket_mb=first_bucket_mb,
                           bucket_mb=bucket_mb, sync_buffers=sync_buffers))
    if world.rank == 0:
        log.info("parallelized %s over %d data-parallel ranks (sync=%s)", type(model).__name__, dims.dp, sync)
    return model, shard
