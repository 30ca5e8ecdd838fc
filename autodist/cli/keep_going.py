"""``autodist run --keep-going``: the ranks of one machine outlive a lost peer (parameter-server training).

torchrun stops every rank as soon as one ends badly: right for synchronous
training, where the others cannot go on without it, wrong for asynchronous
parameter-server training (``autodist.Downpour`` / ``autodist.EASGD``), which
drops a lost worker and finishes with the others. With ``--keep-going``,
``autodist run`` starts the ranks itself, with torchrun's environment
variables (the script and autodist see the same world as under torchrun),
waits for every one, and names the ranks it lost. In synchronous training a
lost rank still ends the job: the others' watchdog names it and they stop, unless
the job is elastic (``autodist run --elastic``: :mod:`autodist.faults.elastic`).
There, this process hosts the rendezvous store (it outlives every rank) and
adds each rank that ends badly to the store's list of gone ranks at once, so
that the others leave the step in flight and go on without it. Across
machines (:class:`Node`) each machine's launcher starts its own ranks, node
0's hosts the store and the others report to it. With ``--max-restarts K`` a
lost rank is started again and joins the others; a job that cannot go on
without a lost rank (its ranks say so in the store) has every rank started
again instead, on a fresh store, to resume from its last checkpoint.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from autodist.cli.launch import failure_of, python_command, root_cause, summary
from autodist.cli.output import LABELLED, Output, RankLines, relay
from autodist.cli.stragglers import Stragglers
from autodist.runtime.environment import exit_timeout, hang_timeout


def _past_the_end(procs: list[subprocess.Popen], ended: dict[int, float]) -> bool:
    """Whether a rank finished cleanly more than ``AUTODIST_EXIT_TIMEOUT`` ago while others still run."""
    done = [when for rank, when in ended.items() if procs[rank].returncode == 0]
    return bool(done) and len(ended) < len(procs) and time.time() - min(done) > exit_timeout()


def _how(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ErrorFile:
    """What ``failure_of`` reads of torchrun's failure records: the rank's error file and when it ended."""

    def __init__(self, path: str, exitcode: int, when: float) -> None:
        self.error_file, self.exitcode, self.timestamp = path, exitcode, when


@dataclass(frozen=True)
class Node:
    """This machine's place in an elastic job across machines: ``count`` nodes, this one ``rank``; the launcher of
    node 0 hosts the store at ``addr:port``."""

    count: int
    rank: int
    addr: str
    port: int


class _Store:
    """The job's rendezvous store, hosted here for an elastic job (so that it outlives every rank); on a node
    other than 0, a client of node 0's."""

    def __init__(self, addr: str, port: int, hosts: bool) -> None:
        import torch.distributed as dist

        from autodist.faults.elastic import FALLBACK, GONE, JOINABLE, PREFIX
        from autodist.faults.liveness import FINISHED

        self.store = dist.TCPStore(addr, port, is_master=hosts, wait_for_workers=False, multi_tenant=True,
                                   timeout=timedelta(minutes=10))
        self.keys = {name: f"{PREFIX}/{key}" for name, key in
                     (("gone", GONE), ("fallback", FALLBACK), ("joinable", JOINABLE), ("finished", FINISHED))}

    def gone(self, member: int) -> None:
        """Report a lost member (quietly where the store is gone: node 0's launcher ended with the job)."""
        try:
            self.store.append(self.keys["gone"], f"{member},")
        except Exception:  # noqa: BLE001
            pass

    def beat(self, member: int) -> int | None:
        """The heartbeat count of ``member`` (None: it has none yet, or the store is gone)."""
        try:
            key = f"{self.keys['gone'].rsplit('/', 1)[0]}/beat/{member}"
            return self.store.add(key, 0) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone: the job ended
            return None

    def said(self, name: str) -> str | None:
        """What the ranks wrote under ``name`` ("fallback": why the job cannot go on without a lost rank;
        "joinable": a lost rank may be started again to join; "finished": a rank reached its end), or None."""
        try:
            key = self.keys[name]
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone: the job ended
            return None


def run_each(nproc: int, script: list[str], workdir: str, output: Output = LABELLED, elastic: bool = False,
             node: Node | None = None, restarts: int = 0) -> int:
    """Run ``nproc`` ranks of ``script`` (the script and its arguments) on this machine; their exit status.

    With ``output`` labelled, the ranks' stdout and stderr are pipes read here, a labelled line at a time
    (see :mod:`autodist.cli.output`); raw, the ranks write to this process's own.

    Returns 0 when every rank that did not die of a signal or an error finished cleanly and rank 0 is among
    them (``elastic``: any rank) (the lost ranks are named); otherwise the first failure's status, as
    ``autodist run`` reports it. ``elastic``: the store is hosted here and each lost rank reported to it;
    ``node``: this machine's place in a job across machines (its ranks numbered after the nodes before it);
    ``restarts``: elastic, how many lost ranks of this machine are started again, each joining the others.

    Example:
        >>> run_each(3, ["train_ps.py", "--epochs", "3"], "/tmp/run")
    """
    job = _Job(nproc, script, workdir, output, elastic, node or Node(1, 0, "127.0.0.1", _free_port()), restarts)
    previous = {s: signal.signal(s, job.stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        job.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return job.outcome()


class _Job:
    """The ranks of this machine: started (:meth:`start`), watched until every one ended (:meth:`wait`: the
    stragglers an elastic job stops, each rank that ends badly reported, started again to join or every rank
    started again to resume), and the job's status (:meth:`outcome`)."""

    def __init__(self, nproc: int, script: list[str], workdir: str, output: Output, elastic: bool, node: Node,
                 restarts: int) -> None:
        self.nproc, self.script, self.workdir, self.output, self.elastic = nproc, script, workdir, output, elastic
        self.node, self.restarts = node, restarts
        self.first = node.rank * nproc  # this machine's first global rank
        self.base = {k: v for k, v in os.environ.items()
                     if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        if elastic:
            self.base |= {"AUTODIST_ELASTIC": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        self.store = _Store(node.addr, node.port, hosts=node.rank == 0) if elastic else None
        self.watch = Stragglers(self.store, hang_timeout(), exit_timeout()) if self.store is not None else None
        self.relays: list[Any] = []
        self.out, self.err = RankLines(sys.stdout, output.shown), RankLines(sys.stderr, output.shown)
        self.procs = [self.start(rank) for rank in range(nproc)]
        self.member = {rank: self.first + rank for rank in range(nproc)}  # elastic: each slot's member number
        self.restarted = 0  # elastic: restarts used, out of ``restarts``
        self.stopped: list[int] = []  # the signals this launcher got
        self.ended: dict[int, float] = {}

    def start(self, rank: int, join: int | None = None) -> subprocess.Popen:
        """Start the rank of slot ``rank`` (``join``: restarted into the running job as that member)."""
        node = self.node
        env = self.base | {"RANK": str(self.first + rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(node.count * self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc),
                           "GROUP_RANK": str(node.rank), "MASTER_ADDR": node.addr, "MASTER_PORT": str(node.port),
                           "TORCHELASTIC_ERROR_FILE": os.path.join(self.workdir, f"{self.first + rank}.json")}
        if join is not None:  # restarted into the running job: it joins the others (autodist.faults.elastic)
            env["AUTODIST_ELASTIC_JOIN"] = str(join)
        # --loopback-store: sockets on 127.0.0.1, the store hosted by rank 0 as without --keep-going (here if
        # elastic); across machines gloo goes out through the interface that reaches node 0
        loopback = ["--loopback-store"] if node.count == 1 else []
        pipe = subprocess.PIPE if self.output.labelled else None
        proc = subprocess.Popen([*python_command("_rank", unbuffered=True), *loopback, *self.script],
                                env=env, stdout=pipe, stderr=pipe)
        if self.output.labelled:
            self.relays += [relay(proc.stdout, self.first + rank, self.out),
                            relay(proc.stderr, self.first + rank, self.err)]
        return proc

    def stop(self, signum: int, _frame: object) -> None:
        """A signal to the launcher: SIGTERM to the ranks, SIGKILL at the second."""
        self.stopped.append(signum)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if len(self.stopped) == 1 else signal.SIGKILL)

    def _say(self, line: str) -> None:
        print(f"autodist run: {line}", file=sys.stderr, flush=True)

    def _kill(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.procs[rank].kill()
            self.procs[rank].wait()

    # -- watching ----------------------------------------------------------------------------------
    def wait(self) -> None:
        """Until every rank ended (an elastic job: the stragglers stopped, each lost rank reported)."""
        while len(self.ended) < self.nproc:
            if self.watch is not None:
                self._stop_stragglers()
            for rank, p in enumerate(self.procs):
                if rank not in self.ended and p.poll() is not None:
                    self.ended[rank] = time.time()
                    if self.store is not None and p.returncode != 0 and self._lost(rank, p):
                        break  # every rank was started again
            time.sleep(0.05)
        read_by = time.monotonic() + 5  # a subprocess a rank left behind may hold its pipe open
        for thread in self.relays:  # the ranks' last lines before this process's own
            thread.join(timeout=max(0.0, read_by - time.monotonic()))

    def _stop_stragglers(self) -> None:
        """Elastic: the members frozen or stuck (:mod:`autodist.cli.stragglers`), and the ranks still running
        ``AUTODIST_EXIT_TIMEOUT`` after another finished, stopped and named."""
        assert self.watch is not None
        for rank, why in self.watch.due({r: self.member[r] for r in range(self.nproc) if r not in self.ended}):
            self._say(f"rank {self.first + rank} stopped: {why}")
            self._kill([rank])
        if _past_the_end(self.procs, self.ended):
            left_behind = [rank for rank in range(self.nproc) if rank not in self.ended]
            self._kill(left_behind)
            self._say(f"{', '.join(f'rank {self.first + r}' for r in left_behind)} still running "
                      f"{exit_timeout():g} s after another rank finished (frozen, or left out by the others): "
                      f"stopped (AUTODIST_EXIT_TIMEOUT)")

    def _lost(self, rank: int, p: subprocess.Popen) -> bool:
        """Elastic: rank ``rank`` ended badly. Reported to the store; then every rank started again (the job
        cannot go on without it: True), or it is started again to join, or the others go on without it."""
        assert self.store is not None
        self.store.gone(self.member[rank])
        why = self.store.said("fallback")
        joinable = self.store.said("joinable") is not None and self.store.said("finished") is None
        if why is not None and self.restarted < self.restarts and self.node.count == 1:
            self._restart_all(rank, p, why)
            return True
        if joinable and self.restarted < self.restarts:
            self._rejoin(rank, p)
        elif len(self.ended) < self.nproc and why is None:
            self._say(f"rank {self.first + rank} ended ({_how(p.returncode)}); the other ranks go on without it "
                      f"(--elastic)")
        return False

    def _restart_all(self, rank: int, p: subprocess.Popen, why: str) -> None:
        self.restarted += 1
        self._say(f"rank {self.first + rank} ended ({_how(p.returncode)}); this job cannot go on without it "
                  f"({why}): every rank starts again, to resume from its last checkpoint ({self.restarted} of "
                  f"{self.restarts})")
        self._kill(list(range(self.nproc)))
        self.fresh_store()
        self.base["TORCHELASTIC_RESTART_COUNT"] = str(self.restarted)
        self.procs[:] = [self.start(r) for r in range(self.nproc)]
        self.member.update({r: self.first + r for r in range(self.nproc)})
        self.ended.clear()

    def fresh_store(self) -> None:
        """A new rendezvous on a new port; the old store's server is shut down (the last reference to a
        hosting TCPStore dropped)."""
        self.store = self.watch = None  # before the new one: nothing else holds the old store
        self.node = dataclasses.replace(self.node, port=_free_port())
        self.store = _Store(self.node.addr, self.node.port, hosts=True)
        self.watch = Stragglers(self.store, hang_timeout(), exit_timeout())

    def _rejoin(self, rank: int, p: subprocess.Popen) -> None:
        self.restarted += 1  # a member number no rank had: node.count * nproc and up, per node
        node = self.node
        join = node.count * self.nproc + node.rank + node.count * (self.restarted - 1)
        self.member[rank] = join
        self._say(f"rank {self.first + rank} ended ({_how(p.returncode)}); restarted ({self.restarted} of "
                  f"{self.restarts}), it joins the others after their next step")
        self.procs[rank] = self.start(rank, join)
        del self.ended[rank]

    # -- the outcome -------------------------------------------------------------------------------
    def outcome(self) -> int:
        """0 where every rank not lost finished cleanly (the lost ones named), else the first failure's
        status, as ``autodist run`` reports it."""
        first, procs = self.first, self.procs
        if self.stopped:
            self._say("interrupted; the ranks were stopped")
            return 128 + self.stopped[0]
        failures = [failure_of(first + rank, _ErrorFile(os.path.join(self.workdir, f"{first + rank}.json"),
                                                        p.returncode, self.ended[rank]))
                    for rank, p in enumerate(procs) if p.returncode != 0]
        if not failures:
            return 0
        finished = any(p.returncode == 0 for p in procs) if self.elastic else procs[0].returncode == 0
        lost_ranks = {f.rank for f in failures}
        if finished and all(f.exitcode < 0 or f.error is not None for f in failures) and \
                all(p.returncode == 0 for rank, p in enumerate(procs) if first + rank not in lost_ranks):
            for f in failures:
                self.err.show_kept(f.rank)  # what a hidden rank said before it was lost
            lost = ", ".join(f"rank {f.rank} ({f.how}{': ' + f.error if f.error else ''})" for f in failures)
            here = " on this machine" if self.node.count > 1 else ""
            self._say(f"finished with {self.nproc - len(failures)} of {self.nproc} ranks{here}; lost {lost}")
            return 0
        self.err.show_kept(root_cause(failures).rank)  # a hidden rank's crash, before the summary
        print("\n".join(summary(failures, self.nproc)), file=sys.stderr, flush=True)
        return root_cause(failures).status
