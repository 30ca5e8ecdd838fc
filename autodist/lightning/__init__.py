"""lightning: :class:`AutodistStrategy`, Lightning's ``Trainer`` training through ``autodist.parallelize`` instead
of DDP - the ranks the launcher started (autodist run, torchrun, mpirun, srun) as Lightning's ranks
(:mod:`~autodist.lightning.environment`), the model parallelized in the strategy's setup, each DataLoader sharded
per global batch instead of Lightning's DistributedSampler, accumulation through ``autodist.no_sync``, dense
checkpoints through Lightning's own saving and loading (:mod:`~autodist.lightning.strategy`), and Lightning's
collectives over autodist's world (:mod:`~autodist.lightning.collectives`). Lightning is an optional dependency
(``pip install autodist[lightning]``): ``import autodist`` never imports this package, which imports Lightning.
May import: ps, planner, train, pp, sync, sharded, dp, mp, cp, ep, layers, faults and runtime (and the public face,
autodist.api: it is the library's user, as cli is). Entry point: :class:`AutodistStrategy`.
"""
import importlib

try:
    importlib.import_module("lightning.pytorch")  # the optional dependency, checked once, here
except ImportError as err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(f"autodist.lightning needs Lightning (the `lightning` package), which is not installed "
                      f"({err}): pip install autodist[lightning]") from err

from autodist.lightning.environment import AutodistEnvironment
from autodist.lightning.strategy import AutodistStrategy

__all__ = ["AutodistStrategy", "AutodistEnvironment"]
