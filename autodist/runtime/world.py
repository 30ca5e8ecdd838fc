"""Joining the ranks: the process group, the backend, the device, and this process's :class:`World`.

What the launcher says comes from :mod:`autodist.runtime.environment`; everything
else in autodist receives a :class:`World` (or values taken from it) as an argument.
"""
from __future__ import annotations

import atexit
from typing import Callable
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autodist.runtime import ending, environment
from autodist.runtime.environment import Launch, rendezvous_address, shared_memory_allowed

log = logging.getLogger("autodist")


def default_timeout() -> timedelta:
    """How long :func:`init` lets torch.distributed wait in a collective: longer than the watchdog's limits
    (``AUTODIST_BUSY_TIMEOUT`` + ``AUTODIST_TIMEOUT`` + a minute), so that a wait is always named by autodist
    first, never ended by torch's bare timeout."""
    return timedelta(seconds=environment.busy_timeout() + environment.hang_timeout() + 60)


def collective_timeout() -> float | None:
    """Seconds the default process group lets a collective wait before it fails (None: no group, or the
    backend does not say)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return min(group._get_backend(d).options._timeout.total_seconds() for d in group._device_types)
    except Exception:  # noqa: BLE001 - private API of torch's: unknown where it changed
        return None


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks)`` with the default group's timeout (new_group's own default, 30
    minutes, could end a wait the watchdog still allows); collective over the world, like new_group."""
    seconds = collective_timeout()
    return dist.new_group(ranks, timeout=None if seconds is None else timedelta(seconds=seconds))


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


def _setup_logging(rank: int) -> None:
    log.setLevel(environment.log_level())
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


_members: Callable[[], tuple[int, int]] | None = None  # elastic: this rank's place among the ranks alive now


def follow_members(place: Callable[[], tuple[int, int]]) -> None:
    """Under ``autodist run --elastic``: :func:`rank` and :func:`world_size` answer from ``place()``, this rank's
    index among the ranks alive now and their number (:mod:`autodist.faults.elastic` calls it once)."""
    global _members
    _members = place


def _place() -> tuple[int, int]:
    if _members is not None:
        return _members()
    if _world is not None:
        return _world.rank, _world.size
    if dist.is_available() and dist.is_initialized():  # a process group started by hand
        return dist.get_rank(), dist.get_world_size()
    launch = environment.launch()
    return launch.rank, launch.size


def rank() -> int:
    """This process's rank among all ranks (0 without a launcher); starts nothing.

    Before :func:`init` it comes from the launcher's environment (torchrun,
    Open MPI, MPICH / Intel MPI, Slurm's srun: the same reading as ``init``),
    so it is right where ``os.environ["RANK"]`` is missing (mpirun, srun).
    Under ``autodist run --elastic`` it is this rank's place among the ranks
    alive now (0 to ``world_size() - 1``): after a loss or a join exactly
    one rank answers 0, the first of them.

    Example:
        >>> import autodist
        >>> autodist.rank(), autodist.world_size()    # plain `python train.py`
        (0, 1)
    """
    return _place()[0]


def world_size() -> int:
    """How many ranks the job has (1 without a launcher); starts nothing. See :func:`rank`: under
    ``autodist run --elastic``, how many are alive now.

    Example:
        >>> if autodist.rank() == 0:
        ...     print(f"training on {autodist.world_size()} processes")
    """
    return _place()[1]


def init(backend: str | None = None, timeout: timedelta | None = None) -> World:
    """Join the ranks started by torchrun, mpirun or srun; idempotent.

    Args:
        backend: "nccl", "gloo" or None to choose (NCCL when every rank has a
            GPU of its own, gloo otherwise).
        timeout: how long torch.distributed lets a collective wait for the other ranks before it fails;
            None: :func:`default_timeout` (``AUTODIST_BUSY_TIMEOUT`` + ``AUTODIST_TIMEOUT`` + 60 s, 32 min
            by default), so that the watchdog names every wait first.

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
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=40), or None (longer "
                        f"than the watchdog's limits), got {timeout!r}")
    if _world is not None:
        if backend is not None and backend != _world.backend:
            raise ValueError(f"autodist is already initialised with backend {_world.backend!r}; "
                             f"cannot switch to {backend!r} in the same process")
        return _world
    launch = environment.launch()
    _setup_logging(launch.rank)
    shared_memory_allowed()  # a bad value raises here, before any rank waits for this one
    environment.exit_timeout()  # and this one before the end of the script, where it is read
    timeout = timeout if timeout is not None else default_timeout()  # reads AUTODIST_BUSY_TIMEOUT / _TIMEOUT
    if dist.is_available() and dist.is_initialized():
        _world = _adopt_existing_group(launch)
        atexit.register(ending.shutdown, destroy=False)  # settle and meet; the group is its starter's to end
        return _world
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = pin_device(launch.local_rank, gpus)
    if launch.size == 1 and launch.launcher == "none":
        _world = World(0, 1, 0, 1, device, None, launch.launcher)
        return _world
    if launch.size == 1:
        # launched as one rank (`autodist run -n 1`, torchrun --nproc-per-node 1): a process group of one, on an
        # in-process store, so that what a DDP script does with torch.distributed (get_rank, barrier,
        # destroy_process_group at its end) works as it would under the launcher it was written for
        chosen, why = choose_backend(backend, gpus, 1)
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        atexit.register(ending.shutdown)
        _world = World(0, 1, 0, 1, device, chosen, launch.launcher, why)
        return _world
    chosen, why = choose_backend(backend, gpus, launch.local_size)
    if environment.elastic_join() is not None:
        # restarted into a running elastic job: the others' default group is gone for good; this rank's own is
        # a group of one, and it sums with them over the group of the generation that admits it
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        atexit.register(ending.shutdown)
        _world = World(launch.rank, launch.size, launch.local_rank, launch.local_size, device, chosen,
                       launch.launcher, why)
        return _world
    host, port = rendezvous_address(launch)
    host = f"[{host}]" if ":" in host else host
    dist.init_process_group(chosen, init_method=f"tcp://{host}:{port}", rank=launch.rank,
                            world_size=launch.size, timeout=timeout)
    # Exiting with a live process group can abort in its background threads ("terminate called
    # without an active exception"): the group autodist started, autodist also ends.
    atexit.register(ending.shutdown)
    # One line on rank 0 says what was chosen and why; parallelize prints it with its own summary,
    # so that a training script's first log line is its own.
    log.debug("%d ranks via %s, backend %s: %s", launch.size, launch.launcher, chosen, why)
    _world = World(launch.rank, launch.size, launch.local_rank, launch.local_size, device, chosen,
                   launch.launcher, why)
    return _world
