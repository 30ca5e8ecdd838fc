"""The ranks as Lightning sees them: the launcher's, as ``autodist.init`` read them (a :class:`World`)."""
from __future__ import annotations

from lightning.fabric.plugins.environments import ClusterEnvironment

from autodist.runtime.world import World


class AutodistEnvironment(ClusterEnvironment):
    """Lightning's ``ClusterEnvironment`` for the processes autodist joined: rank, world size, local rank and
    node from the :class:`~autodist.World` of ``autodist.init()``. Lightning starts no process and reads no
    variable of its own: the launcher (``autodist run``, torchrun, mpirun, srun) or an already started process
    group says who each process is.

    :class:`~autodist.lightning.AutodistStrategy` brings it and binds the world when the ``Trainer`` is built.

    Example:
        >>> env = AutodistEnvironment(autodist.init())
        >>> env.global_rank(), env.world_size()
        (0, 1)
    """

    def __init__(self, world: World | None = None) -> None:
        self._world = world

    def bind(self, world: World) -> None:
        self._world = world

    @property
    def bound(self) -> bool:
        """Whether the ranks are joined and bound here yet."""
        return self._world is not None

    @property
    def world(self) -> World:
        if self._world is None:
            raise RuntimeError("the AutodistEnvironment has no ranks yet: build the Trainer with "
                               "strategy=AutodistStrategy(...), which joins them (autodist.init) and binds them here")
        return self._world

    @property
    def creates_processes_externally(self) -> bool:
        return True  # Lightning launches nothing: the processes are the launcher's

    @property
    def main_address(self) -> str:
        raise RuntimeError("autodist joined the ranks itself (autodist.init): it has no rendezvous address to hand "
                           "to a Lightning launcher; use AutodistStrategy, which needs none")

    @property
    def main_port(self) -> int:
        raise RuntimeError("autodist joined the ranks itself (autodist.init): it has no rendezvous port to hand to "
                           "a Lightning launcher; use AutodistStrategy, which needs none")

    @staticmethod
    def detect() -> bool:
        return False  # never chosen by Lightning from the environment: AutodistStrategy brings it

    def world_size(self) -> int:
        return self.world.size

    def set_world_size(self, size: int) -> None:
        self._refuse("world size", size, self.world.size)

    def global_rank(self) -> int:
        return self.world.rank

    def set_global_rank(self, rank: int) -> None:
        self._refuse("global rank", rank, self.world.rank)

    def local_rank(self) -> int:
        return self.world.local_rank

    def node_rank(self) -> int:
        return self.world.rank // self.world.local_size

    def _refuse(self, what: str, value: int, launched: int) -> None:
        if value != launched:
            raise ValueError(f"Lightning set this process's {what} to {value}, but the launcher made it {launched}: "
                             f"under AutodistStrategy the ranks are the launcher's")
