"""What the launcher and the user set in the environment: the one module of the library that reads it (the
``autodist`` command in :mod:`autodist.cli` reads and sets the environment of the processes it starts).

torchrun's, Open MPI's, MPICH's and Slurm's variables say who this process is
(:func:`detect_launch`); ``MASTER_ADDR`` / ``MASTER_PORT`` where the ranks meet;
``AUTODIST_*`` tune autodist. Everything else receives these values as arguments.

Example:
    >>> detect_launch({"RANK": "1", "WORLD_SIZE": "2"}).size
    2
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping


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

_LAUNCHERS = {"torchrun": "a torchrun", "openmpi": "an Open MPI", "mpich": "an MPICH", "slurm": "a Slurm"}
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
            f"autodist found {_LAUNCHERS[launch.launcher]} launch of {launch.size} ranks but no rendezvous address: "
            f"set {' and '.join(missing)} in every rank's environment "
            f"(MASTER_ADDR = host name of rank 0, MASTER_PORT = a free TCP port), "
            f"{_ADDR_HINTS[launch.launcher]}"
        )
    try:
        return addr, int(launch.master_port)  # type: ignore[arg-type]
    except ValueError:
        raise RuntimeError(f"MASTER_PORT={launch.master_port!r} is not a port number") from None


def _positive(env: Mapping[str, str], name: str, default: str | None, unit: str) -> float | None:
    """The positive number ``name`` holds (``default`` where unset; None for no default), or an error naming it."""
    text = env.get(name, default)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of {unit}") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r}: give a positive number of {unit}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: str) -> float:
    return _positive(env, name, default, "seconds")  # type: ignore[return-value]


def hang_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a rank may wait in a collective for the others before the watchdog stops every rank:
    ``AUTODIST_TIMEOUT``, 60 by default.

    Example:
        >>> hang_timeout({"AUTODIST_TIMEOUT": "5"})
        5.0
    """
    return _seconds(env, "AUTODIST_TIMEOUT", "60")


def elastic(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the ranks left after one is lost go on (``autodist run --elastic`` sets ``AUTODIST_ELASTIC=1``);
    the launcher then hosts the rendezvous store, so that it outlives every rank.

    Example:
        >>> elastic({"AUTODIST_ELASTIC": "1"}), elastic({})
        (True, False)
    """
    text = env.get("AUTODIST_ELASTIC", "0")
    if text not in ("0", "1"):
        raise ValueError(f"AUTODIST_ELASTIC={text!r}: give 1 (the ranks left after one is lost go on) or 0")
    return text == "1"


def elastic_join(env: Mapping[str, str] = os.environ) -> int | None:
    """The member number of a rank the launcher restarted into a running elastic job, which joins the others
    (``AUTODIST_ELASTIC_JOIN``, set by ``autodist run --elastic --max-restarts K``); None for a rank that
    started with them.

    Example:
        >>> elastic_join({"AUTODIST_ELASTIC_JOIN": "3"}), elastic_join({})
        (3, None)
    """
    text = env.get("AUTODIST_ELASTIC_JOIN")
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"AUTODIST_ELASTIC_JOIN={text!r}: the launcher sets it to the joining rank's number")
    return int(text)


def busy_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a rank waiting in a collective waits for a rank that is alive and in its own code (evaluating,
    saving or logging alone; its heartbeat goes on) before the watchdog stops every rank:
    ``AUTODIST_BUSY_TIMEOUT``, 1800 (30 minutes, torch's process-group timeout for gloo) by default. A rank
    that is silent or waits in another collective is named after ``AUTODIST_TIMEOUT`` all the same.

    Example:
        >>> busy_timeout({"AUTODIST_BUSY_TIMEOUT": "600"})
        600.0
    """
    return _seconds(env, "AUTODIST_BUSY_TIMEOUT", "1800")


def exit_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a rank that reached the end of its script waits for the others to reach theirs before it
    names the missing ranks and leaves with status 1: ``AUTODIST_EXIT_TIMEOUT``, 60 by default.

    Example:
        >>> exit_timeout({"AUTODIST_EXIT_TIMEOUT": "10"})
        10.0
    """
    return _seconds(env, "AUTODIST_EXIT_TIMEOUT", "60")


def memory_budget(env: Mapping[str, str] = os.environ) -> float | None:
    """Bytes of memory each rank may use, as ``plan="auto"`` plans and ``parallelize`` warns by:
    ``AUTODIST_BUDGET_GB`` (GB of 10**9 bytes); None (unset): the device's free memory.

    Example:
        >>> memory_budget({"AUTODIST_BUDGET_GB": "6"})
        6000000000.0
    """
    value = _positive(env, "AUTODIST_BUDGET_GB", None, "GB per rank")
    return None if value is None else value * 1e9


def error_file(env: Mapping[str, str] = os.environ) -> str | None:
    """Where the launcher (torchrun, ``autodist run``) reads this rank's error: ``TORCHELASTIC_ERROR_FILE``."""
    return env.get("TORCHELASTIC_ERROR_FILE") or None


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
    """Whether ranks on one machine may sum gradients, and the MP layers' activations and input gradients,
    through shared memory: ``AUTODIST_SHARED_MEMORY``, 1 (the default) or 0 (always gloo's all-reduce).

    Example:
        >>> shared_memory_allowed({"AUTODIST_SHARED_MEMORY": "0"})
        False
    """
    return _switch(env, "AUTODIST_SHARED_MEMORY", "1", "give 1 (ranks on one machine sum gradients and "
                   "model-parallel all-reduces through shared memory, the default) or 0 (always through the "
                   "backend's all-reduce)")


def resume_any_data(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a resumed loader goes on where the data it passes over is not what the checkpoint's run took:
    ``AUTODIST_RESUME_ANY_DATA``, 0 (the default: an error) or 1 (a warning, and the run goes on from the same
    batch number of the data as it is now).

    Example:
        >>> resume_any_data({"AUTODIST_RESUME_ANY_DATA": "1"})
        True
    """
    return _switch(env, "AUTODIST_RESUME_ANY_DATA", "0", "give 0 (a resume whose data changed since the save is "
                   "an error, the default) or 1 (it warns and goes on from the same batch number)")


def _switch(env: Mapping[str, str], name: str, default: str, what_to_give: str) -> bool:
    """A 0/1 variable: True for 1; any other value than 0 or 1 is an error naming it and ``what_to_give``."""
    text = env.get(name, default)
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: {what_to_give}")
    return text == "1"


def launch() -> Launch:
    """This process's launch, from its environment (:func:`detect_launch` of ``os.environ``)."""
    return detect_launch(os.environ)


def log_level(env: Mapping[str, str] = os.environ) -> str:
    """The level of autodist's log: ``AUTODIST_LOG_LEVEL``, INFO by default."""
    return env.get("AUTODIST_LOG_LEVEL", "INFO").upper()
