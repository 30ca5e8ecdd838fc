"""The memory a rank may use, by default: ``AUTODIST_BUDGET_GB`` where it is set; else on CUDA the GPU's free
memory shared by the ranks on that GPU (several processes may share one), on CPU the host's available memory
(or what the process's cgroup still allows, where that is less) shared by this host's ranks; plus what the
model already holds there (a layout's prediction counts the model's bytes, which are held now and freed or
kept by the layout). The planner takes the smallest over the ranks.

Example:
    >>> default_budget(model, world)          # bytes
    11543219404.8
"""
from __future__ import annotations

import os

import torch
from torch import nn

from autodist.planner.profile import nbytes
from autodist.runtime.environment import memory_budget
from autodist.runtime.world import World


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _available_host_bytes() -> float:
    """MemAvailable of /proc/meminfo (what can be used without swapping; free pages where it is missing),
    or what the cgroup (v2) still allows this process, where that is less."""
    meminfo = _read("/proc/meminfo") or ""
    found = [float(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    available = found[0] if found else float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and used and limit.strip().isdigit() and used.strip().isdigit():
        available = min(available, float(int(limit) - int(used)))
    return available


def sharing_a_gpu(local_rank: int, local_ranks: int, gpus: int) -> int:
    """How many of a host's ``local_ranks`` share the GPU of ``local_rank`` (ranks are pinned to its ``gpus``
    round-robin: :func:`autodist.runtime.world.pin_device`).

    Example:
        >>> sharing_a_gpu(0, 2, 1), sharing_a_gpu(5, 8, 8), sharing_a_gpu(0, 3, 2), sharing_a_gpu(1, 3, 2)
        (2, 1, 2, 1)
    """
    gpus = max(1, gpus)
    return max(1, len(range(local_rank % gpus, local_ranks, gpus)))


def default_budget(model: nn.Module, world: World) -> float:
    """Bytes this rank may hold for the model by default (not yet the minimum over the ranks)."""
    told = memory_budget()
    if told is not None:
        return told
    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    held = nbytes(tensors)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / sharing_a_gpu(world.local_rank, world.local_size, torch.cuda.device_count()) + held
    return _available_host_bytes() / max(1, world.local_size) + held
