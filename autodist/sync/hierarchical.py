"""Hierarchical: exact sync among the ranks of each host at every step, a cheaper mode between hosts
(TorchMPI's hierarchical communicators: all-reduce inside a machine, something cheaper between machines)."""
from __future__ import annotations

from typing import Any

from torch import nn

from autodist.dp.grad_sync import GradSync
from autodist.dp.shares import Counted, SampleCounter
from autodist.runtime import comm, provenance
from autodist.sync.base import Strategy, SyncContext
from autodist.sync.local_sgd import LocalSGD
from autodist.sync.periodic import Periodic
from autodist.sync.stepping import StepWatch


class _HostCounter(SampleCounter):
    """Counts as the model's counter does, but leaves the global batch size out: the host's exact sync then
    weighs its ranks by their share of the host's samples, which its all-reduce sums."""

    def __init__(self, counter: SampleCounter) -> None:
        super().__init__(counter.batch_dim, counter.samples, counter.tokens)
        self.inner = counter

    def __call__(self, args: tuple, kwargs: dict) -> Counted:
        counted = self.inner(args, kwargs)
        return Counted(counted.count, None, counted.batch, counted.error)

    def of_share(self, share: provenance.BatchShare) -> Counted:
        return Counted(share.count, None, share.batch)


class Hierarchical(Strategy):
    """Gradients are averaged exactly among the ranks of each host at every backward (as ``sync="backward"``
    does over all ranks), so the replicas of one host never differ; between hosts, ``across`` (local SGD or
    DiLoCo) meets every H steps. Each host's meeting costs one model over the slow link in all: member i of
    a host averages the i-th of k chunks with its peers on the other hosts, then the host all-gathers them.

    Args:
        across: the mode between hosts, ``autodist.LocalSGD(...)`` (default ``LocalSGD(every=16)``) or
            ``autodist.DiLoCo(...)``, without warmup; each host counts as one replica, weighted by the
            samples its ranks trained on.
        ranks_per_host: ranks on each host, hosts holding consecutive ranks (default: the launcher's local
            world size, e.g. torchrun's ``--nproc-per-node``).

    What it promises instead of exactness:
        * the ranks of one host hold the very same parameters after every step;
        * the hosts meet as ``across`` promises: with ``LocalSGD(every=H)`` every host holds the very same
          model right after each average; with ``LocalSGD(every=1)`` and plain SGD it is the exact run;
        * between hosts each rank sends 2 (h - 1) / h of 1/k of a model per meeting (h hosts of k ranks):
          ``bytes_across_hosts``; ``bytes_sent`` adds the exact sync within the host (an estimate: one
          gradient all-reduce per step).

    Example:
        >>> sync = autodist.Hierarchical(across=autodist.DiLoCo(every=64))
        >>> model, loader = autodist.parallelize(model, loader, sync=sync)
        >>> ...                                   # the ordinary loop
        >>> sync.bytes_across_hosts               # what crossed the slow link, from this rank

    Note:
        Data parallelism only (``mp=1``). ``autodist.no_sync`` and ``autodist.synchronize_model`` act on the
        host's exact sync; ``synchronize_model(model, what="parameters")`` averages over every rank.
    """

    name = "hierarchical"

    def __init__(self, *, across: Periodic | None = None, ranks_per_host: int | None = None) -> None:
        super().__init__()
        self.across = LocalSGD() if across is None else across
        if not isinstance(self.across, Periodic):
            raise TypeError(f"across must be autodist.LocalSGD(...) or autodist.DiLoCo(...), the mode between "
                            f"hosts; got {type(across).__name__} {across!r:.60}")
        if ranks_per_host is not None and (not isinstance(ranks_per_host, int) or isinstance(ranks_per_host, bool)
                                           or ranks_per_host < 1):
            raise ValueError(f"ranks_per_host must be a positive int (or None: the launcher's local size), got "
                             f"{ranks_per_host!r}")
        self.ranks_per_host = ranks_per_host
        self._host_sent = 0.0

    def _start(self, model: nn.Module, ctx: SyncContext) -> GradSync:
        assert self._comm is not None
        if self._comm.ranks != tuple(range(comm.world().size)):
            raise NotImplementedError(f"Hierarchical syncs data-parallel replicas by host and supports mp=1 only; "
                                      f"with model parallelism the data-parallel ranks are {list(self._comm.ranks)}")
        self.host = comm.host(self.ranks_per_host)
        self.between = comm.across_hosts(self.ranks_per_host)
        self._between_before = self.between.bytes_sent
        exact = GradSync(model, self.host.group, hooks=True, first_bucket_mb=ctx.first_bucket_mb,
                         bucket_mb=ctx.bucket_mb, sync_buffers=ctx.sync_buffers, counter=_HostCounter(ctx.counter))
        self.across.start_two_level(model, ctx, self.host, self.between)
        k = self.host.size
        self._per_step = comm.ring_bytes([p for p in model.parameters() if p.requires_grad], k)
        self.watch = StepWatch(model, self._after_step)
        return exact

    def _after_step(self) -> None:
        self._host_sent += self._per_step

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent: the gradients within its host (estimated) and the meetings between hosts."""
        return self._host_sent + self.across.bytes_sent

    @property
    def bytes_across_hosts(self) -> float:
        """Bytes this rank sent to other hosts (ring estimate, see ``autodist.comm``)."""
        return self.between.bytes_sent - self._between_before

    @property
    def syncs(self) -> int:
        """Meetings between hosts so far."""
        return self.across.syncs

    def state_dict(self) -> dict[str, Any]:
        return {"across": self.across.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.across.load_state_dict(None if state is None else state["across"])

    def __repr__(self) -> str:
        return f"Hierarchical(across={self.across!r}, ranks_per_host={self.ranks_per_host})"
