"""Launcher detection, process-group start-up, backend choice and device pinning.

This is the one module of autodist that reads the environment. Everything else
receives a :class:`World` (or values taken from it) as an argument.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

log = logging.getLogger("autodist")

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process: who it is and where the ranks meet."""

    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "none"
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str | None
    master_port: str | None


@dataclass(frozen=True)
class World:
    """This process's place among the ranks, as returned by :func:`init`.

    Example:
        >>> import autodist
        >>> world = autodist.init()
        >>> world.rank, world.size
        (0, 1)
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    backend: str | None  # None in a world of one: no process group exists
    launcher: str = "none"
    reason: str = ""  # why this backend, in words (parallelize puts it in its log line)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_world: World | None = None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """Expand Slurm's compressed count list ("2(x3),1") and pick this node's entry."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else None


def detect_launch(env: Mapping[str, str]) -> Launch:
    """Work out rank, size and local placement from a launcher's environment.

    torchrun's variables win over MPI's and Slurm's (torchrun may itself run
    under Slurm); without any launcher this is a world of one.

    Example:
        >>> detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
        1
    """
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        size = _int(env, "WORLD_SIZE")
        local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size
        return Launch("torchrun", _int(env, "RANK"), size, int(env.get("LOCAL_RANK", 0)), local_size, addr, port)
    if "OMPI_COMM_WORLD_RANK" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        return Launch("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), size,
                      int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                      int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)), addr, port)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        size = _int(env, "PMI_SIZE")
        return Launch("mpich", _int(env, "PMI_RANK"), size, int(env.get("MPI_LOCALRANKID", 0)),
                      int(env.get("MPI_LOCALNRANKS", size)), addr, port)
    # SLURM_PROCID is also set inside a plain sbatch script; only srun sets the step's task count.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        size = _int(env, "SLURM_STEP_NUM_TASKS")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", str(size)))
        local_size = _slurm_tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0))) or size
        return Launch("slurm", _int(env, "SLURM_PROCID"), size, int(env.get("SLURM_LOCALID", 0)),
                      local_size, addr, port)
    return Launch("none", 0, 1, 0, 1, None, None)


_ADDR_HINTS = {
    "openmpi": "e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...",
    "mpich": "e.g. mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500 ...",
    "slurm": "e.g. export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
             "MASTER_PORT=29500 before srun",
    "torchrun": "torchrun normally sets both; check its --master-addr/--master-port or rendezvous options",
}


def rendezvous_address(launch: Launch) -> tuple[str, int]:
    """The (host, port) where rank 0 listens, or an error naming the variable to set.

    On a single node the host defaults to 127.0.0.1; the port never defaults,
    because two jobs on one machine must not silently meet on the same port.
    """
    addr = launch.master_addr or ("127.0.0.1" if launch.local_size == launch.size else None)
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", launch.master_port)) if not value]
    if missing:
        raise RuntimeError(
            f"autodist found a {launch.launcher} launch of {launch.size} ranks but no rendezvous address: "
            f"set {' and '.join(missing)} in every rank's environment "
            f"(MASTER_ADDR = host name of rank 0, MASTER_PORT = a free TCP port), "
            f"{_ADDR_HINTS[launch.launcher]}"
        )
    try:
        return addr, int(launch.master_port)  # type: ignore[arg-type]
    except ValueError:
        raise RuntimeError(f"MASTER_PORT={launch.master_port!r} is not a port number") from None


def choose_backend(requested: str | None, gpus_on_node: int, local_size: int) -> tuple[str, str]:
    """Pick the collective backend and say why, in words for the log.

    NCCL needs a GPU of its own for every rank; with more ranks than GPUs on a
    node (several processes per GPU) gloo is used, on the GPUs or the CPU.

    Example:
        >>> choose_backend(None, gpus_on_node=0, local_size=2)[0]
        'gloo'
    """
    if requested is not None:
        return requested, "as requested"
    if gpus_on_node == 0:
        return "gloo", "no CUDA device is available"
    if local_size > gpus_on_node:
        return "gloo", (f"{local_size} ranks on this node share {gpus_on_node} GPU(s) and NCCL needs "
                        f"one GPU per rank; tensors stay on the GPUs, communication goes through gloo")
    return "nccl", f"each of the {local_size} rank(s) on this node has a GPU of its own"


def pin_device(local_rank: int, gpus_on_node: int) -> torch.device:
    """GPUs are handed out round-robin by local rank; the CPU where there is none."""
    if gpus_on_node == 0:
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % gpus_on_node)
    torch.cuda.set_device(device)
    return device


def hang_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a rank may wait in a collective for the others before the watchdog stops every rank:
    ``AUTODIST_TIMEOUT``, 60 by default.

    Example:
        >>> hang_timeout({"AUTODIST_TIMEOUT": "5"})
        5.0
    """
    text = env.get("AUTODIST_TIMEOUT", "60")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"AUTODIST_TIMEOUT={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"AUTODIST_TIMEOUT={text!r}: give a positive number of seconds")
    return value


def machine(env: Mapping[str, str] = os.environ) -> str:
    """This rank's machine as the launcher placed it: the host name, and the launcher's node number where
    it gives one (torchrun's ``GROUP_RANK``, Slurm's ``SLURM_NODEID``), so that ranks the launcher put on
    two nodes never count as one machine, even where the nodes share a host name and a file system.

    Example:
        >>> machine({"GROUP_RANK": "1"}).endswith("/node 1")
        True
    """
    node = env.get("GROUP_RANK", env.get("SLURM_NODEID"))
    return socket.gethostname() + ("" if node is None else f"/node {node}")


def shared_memory_allowed(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ranks on one machine may sum gradients through shared memory: ``AUTODIST_SHARED_MEMORY``,
    1 (the default) or 0 (always gloo's all-reduce).

    Example:
        >>> shared_memory_allowed({"AUTODIST_SHARED_MEMORY": "0"})
        False
    """
    text = env.get("AUTODIST_SHARED_MEMORY", "1")
    if text not in ("0", "1"):
        raise ValueError(f"AUTODIST_SHARED_MEMORY={text!r}: give 1 (sum gradients of ranks on one machine "
                         f"through shared memory, the default) or 0 (always through the backend's all-reduce)")
    return text == "1"


def _setup_logging(rank: int) -> None:
    level = os.environ.get("AUTODIST_LOG_LEVEL", "INFO").upper()
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[autodist rank {rank}] %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _adopt_existing_group(launch: Launch) -> World:
    """The user (or a test harness) started the process group already: use it as it is."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = dist.get_backend()
    size = dist.get_world_size()
    local_size = launch.local_size if launch.size == size else size
    local_rank = launch.local_rank if launch.size == size else dist.get_rank() % local_size
    device = pin_device(local_rank, gpus)
    return World(dist.get_rank(), size, local_rank, local_size, device, backend, launch.launcher,
                 "the process group was started before autodist.init()")


def _shutdown() -> None:
    """At exit: all ranks leave together, then the group they share is torn down.

    gloo's worker threads release finished work objects after the caller has
    seen them complete, and releasing one can need the GIL; if the interpreter
    is already finalizing by then, the process aborts at exit ("terminate
    called without an active exception"). So: a barrier (nobody is still
    sending), the group destroyed, garbage collected while the interpreter is
    whole, and a moment with the GIL released for those threads to finish.
    """
    if dist.is_available() and dist.is_initialized():
        # A rank dying of an unhandled exception skips the barrier: its peers may be inside another
        # collective, which the barrier must not be matched with.
        if getattr(sys, "last_value", None) is None:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer that died already: tear down what is left anyway
                pass
        dist.destroy_process_group()
        gc.collect()
        time.sleep(0.1)


def _place() -> tuple[int, int]:
    if _world is not None:
        return _world.rank, _world.size
    if dist.is_available() and dist.is_initialized():  # a process group started by hand
        return dist.get_rank(), dist.get_world_size()
    launch = detect_launch(os.environ)
    return launch.rank, launch.size


def rank() -> int:
    """This process's rank among all ranks (0 without a launcher); starts nothing.

    Before :func:`init` it comes from the launcher's environment (torchrun,
    Open MPI, MPICH / Intel MPI, Slurm's srun: the same reading as ``init``),
    so it is right where ``os.environ["RANK"]`` is missing (mpirun, srun).

    Example:
        >>> import autodist
        >>> autodist.rank(), autodist.world_size()    # plain `python train.py`
        (0, 1)
    """
    return _place()[0]


def world_size() -> int:
    """How many ranks the job has (1 without a launcher); starts nothing. See :func:`rank`.

    Example:
        >>> if autodist.rank() == 0:
        ...     print(f"training on {autodist.world_size()} processes")
    """
    return _place()[1]


def init(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> World:
    """Join the ranks started by torchrun, mpirun or srun; idempotent.

    Args:
        backend: "nccl", "gloo" or None to choose (NCCL when every rank has a
            GPU of its own, gloo otherwise).
        timeout: how long a collective may wait for the other ranks before failing.

    Returns:
        The :class:`World`: rank, size, local rank / size, pinned device, backend.

    Example:
        >>> import autodist
        >>> world = autodist.init()    # no launcher: a world of one, no process group
        >>> world.size
        1

    Note:
        Without a launcher nothing is started and everything in autodist works
        unchanged in the one process. Call it again and you get the same World.
    """
    global _world
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None (chosen for you: NCCL when every rank has a "
                         f"GPU of its own, gloo otherwise), got {backend!r}")
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=10), got {timeout!r}")
    if _world is not None:
        if backend is not None and backend != _world.backend:
            raise ValueError(f"autodist is already initialised with backend {_world.backend!r}; "
                             f"cannot switch to {backend!r} in the same process")
        return _world
    launch = detect_launch(os.environ)
    _setup_logging(launch.rank)
    shared_memory_allowed()  # a bad value raises here, before any rank waits for this one
    if dist.is_available() and dist.is_initialized():
        _world = _adopt_existing_group(launch)
        return _world
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = pin_device(launch.local_rank, gpus)
    if launch.size == 1:
        _world = World(0, 1, 0, 1, device, None, launch.launcher)
        return _world
    chosen, why = choose_backend(backend, gpus, launch.local_size)
    host, port = rendezvous_address(launch)
    host = f"[{host}]" if ":" in host else host
    dist.init_process_group(chosen, init_method=f"tcp://{host}:{port}", rank=launch.rank,
                            world_size=launch.size, timeout=timeout)
    # Exiting with a live process group can abort in its background threads ("terminate called
    # without an active exception"): the group autodist started, autodist also ends.
    atexit.register(_shutdown)
    # One line on rank 0 says what was chosen and why; parallelize prints it with its own summary,
    # so that a training script's first log line is its own.
    log.debug("%d ranks via %s, backend %s: %s", launch.size, launch.launcher, chosen, why)
    _world = World(launch.rank, launch.size, launch.local_rank, launch.local_size, device, chosen,
                   launch.launcher, why)
    return _world
