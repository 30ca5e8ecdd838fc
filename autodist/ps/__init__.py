"""ps: parameter-server training, a strategy with servers: :class:`Downpour` (asynchronous SGD) and
:class:`EASGD` (elastic averaging). May import: train, pp, sync, sharded, dp, mp, cp, ep, layers, faults, runtime
(train for its checkpoint file). Entry points: the two classes, ``parallelize(..., sync=autodist.Downpour())``.

``parallelize(model, data, sync=autodist.Downpour())`` and the ordinary loop
(zero_grad, backward, step) train asynchronously: no worker ever waits for
another (unless ``staleness`` bounds how far ahead one may run).

Design note
-----------
Where the servers live. TorchMPI gave each process a thread pool that served
a shard beside the worker; dedicated server ranks are the other classic
layout. Here servers are threads inside the first ``servers`` ranks (rank 0
alone by default), and every rank is a worker. Why: ``parallelize`` shards the
data over every rank and the user's script runs unchanged on each, so a rank
that only served would have to stop running the script at ``parallelize`` and
could not evaluate or save; and a serving thread costs a worker little (an
update is a few vector operations under a lock). Why not a shard on *every*
rank: the shards are the only up-to-date copy of the parameters, so a rank
holding one cannot be lost; keeping the servers on a few ranks leaves every
other rank free to die without stopping the job. Rank 0 hosts the rendezvous
store under most launchers, so it could not be lost anyway.

Sharding. The trainable parameters, laid end to end, are cut into
``servers`` equal contiguous ranges (:class:`~autodist.ps.layout.ShardLayout`):
balanced by size whatever the tensors' sizes, one message per server per
request. The server's optimizer is the worker's own class over the pieces of
parameters its range holds, so any element-wise optimizer (SGD, Adam, ...)
computes what it would on the whole tensor.

The wire. Point-to-point sends and receives with tags on a gloo process
group of the strategy's own (:mod:`autodist.ps.wire`), so parameter-server
traffic never meets the collectives of the default group (the watchdog's,
the loader's order, checkpoints). Each server rank runs one thread per remote
worker, blocked in a receive from it: requests from different workers are
served concurrently, updates to the shard are serialized by its lock. gloo
process groups are safe to use from several threads for point-to-point
traffic (each send/recv is its own work on its own pair of ranks; verified
with concurrent collectives on the default group); the design keeps at most
one thread per pair and direction and tag. A worker whose process dies
closes its sockets: the server's receive from it fails at once, and the
server drops it. ``torch.distributed.rpc`` was the other candidate: it is in
maintenance mode, its agent is process-wide (one per process, so a test pool
or two strategies cannot each have one), and its shutdown is a barrier over
every worker, which a dead worker never joins; gloo's point-to-point needs
nothing beyond the process group autodist already has.

Ends of passes. When a pass over the loader ``parallelize`` returned ends,
the worker pulls (Downpour: the servers' current parameters; EASGD: the
center), so the evaluation after an epoch sees them, without waiting for
other workers. :meth:`~autodist.ps.strategy.ParameterServer.close` (called
at exit if not before) waits until every worker has finished or died, gives
every rank the final parameters and lets the servers stop.

Faults. A lost worker is dropped by every server and reported to the
watchdog (:func:`autodist.faults.watchdog.rank_left`), which then no longer waits for
it; the job finishes with the others and says so. A lost server raises
:class:`~autodist.ps.strategy.ServerLost` on every worker that asks it
anything. After a worker is lost the default group's collectives cannot run
(``autodist.save``, a loader shuffled from the global RNG): checkpoint with
``ps.save(path)`` on one rank, and shuffle with a generator of the loader's own.
"""
from autodist.ps.downpour import Downpour
from autodist.ps.easgd import EASGD
from autodist.ps.strategy import ParameterServer, ServerLost

__all__ = ["Downpour", "EASGD", "ParameterServer", "ServerLost"]
