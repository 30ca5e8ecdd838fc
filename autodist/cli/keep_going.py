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
    node = node or Node(1, 0, "127.0.0.1", _free_port())
    store = _Store(node.addr, node.port, hosts=node.rank == 0) if elastic else None
    first = node.rank * nproc  # this machine's first global rank
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    if elastic:
        base |= {"AUTODIST_ELASTIC": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    relays: list[Any] = []
    out, err = RankLines(sys.stdout, output.shown), RankLines(sys.stderr, output.shown)
    pipe = subprocess.PIPE if output.labelled else None

    def start(rank: int, join: int | None = None) -> subprocess.Popen:
        env = base | {"RANK": str(first + rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(node.count * nproc),
                      "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node.rank), "MASTER_ADDR": node.addr,
                      "MASTER_PORT": str(node.port),
                      "TORCHELASTIC_ERROR_FILE": os.path.join(workdir, f"{first + rank}.json")}
        if join is not None:  # restarted into the running job: it joins the others (autodist.faults.elastic)
            env["AUTODIST_ELASTIC_JOIN"] = str(join)
        # --loopback-store: sockets on 127.0.0.1, the store hosted by rank 0 as without --keep-going (here if
        # elastic); across machines gloo goes out through the interface that reaches node 0
        loopback = ["--loopback-store"] if node.count == 1 else []
        proc = subprocess.Popen([*python_command("_rank", unbuffered=True), *loopback, *script],
                                env=env, stdout=pipe, stderr=pipe)
        if output.labelled:
            relays.extend([relay(proc.stdout, first + rank, out), relay(proc.stderr, first + rank, err)])
        return proc

    procs = [start(rank) for rank in range(nproc)]
    member = {rank: first + rank for rank in range(nproc)}  # elastic: each slot's number among the members
    restarted = 0  # elastic: restarts used, out of ``restarts``
    stopped: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if len(stopped) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    ended: dict[int, float] = {}
    left_behind: list[int] = []  # elastic: ranks still running AUTODIST_EXIT_TIMEOUT after another finished
    watch = Stragglers(store, hang_timeout(), exit_timeout()) if store is not None else None
    try:
        while len(ended) < nproc:
            for rank, why in watch.due({r: member[r] for r in range(nproc) if r not in ended}) if watch else ():
                print(f"autodist run: rank {first + rank} stopped: {why}", file=sys.stderr, flush=True)
                procs[rank].kill()
                procs[rank].wait()
            if store is not None and _past_the_end(procs, ended):
                left_behind = [rank for rank, p in enumerate(procs) if rank not in ended]
                for rank in left_behind:
                    procs[rank].kill()
                    procs[rank].wait()
                print(f"autodist run: {', '.join(f'rank {first + r}' for r in left_behind)} still running "
                      f"{exit_timeout():g} s after another rank finished (frozen, or left out by the others): "
                      f"stopped (AUTODIST_EXIT_TIMEOUT)", file=sys.stderr, flush=True)
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
                    if store is not None and p.returncode != 0:
                        store.gone(member[rank])
                        why = store.said("fallback")
                        joinable = store.said("joinable") is not None and store.said("finished") is None
                        if why is not None and restarted < restarts and node.count == 1:
                            restarted += 1
                            print(f"autodist run: rank {first + rank} ended ({_how(p.returncode)}); this job cannot "
                                  f"go on without it ({why}): every rank starts again, to resume from its last "
                                  f"checkpoint ({restarted} of {restarts})", file=sys.stderr, flush=True)
                            for other in procs:
                                other.kill()
                                other.wait()
                            node = dataclasses.replace(node, port=_free_port())  # a fresh store: a new rendezvous
                            store = _Store(node.addr, node.port, hosts=True)
                            watch = Stragglers(store, hang_timeout(), exit_timeout())
                            base["TORCHELASTIC_RESTART_COUNT"] = str(restarted)
                            procs[:] = [start(r) for r in range(nproc)]
                            member.update({r: first + r for r in range(nproc)})
                            ended.clear()
                            break
                        if joinable and restarted < restarts:
                            restarted += 1  # a member number no rank had: node.count * nproc and up, per node
                            join = node.count * nproc + node.rank + node.count * (restarted - 1)
                            member[rank] = join
                            print(f"autodist run: rank {first + rank} ended ({_how(p.returncode)}); restarted "
                                  f"({restarted} of {restarts}), it joins the others after their next step",
                                  file=sys.stderr, flush=True)
                            procs[rank] = start(rank, join)
                            del ended[rank]
                        elif len(ended) < nproc and why is None:
                            print(f"autodist run: rank {first + rank} ended ({_how(p.returncode)}); the other ranks go "
                                  f"on without it (--elastic)", file=sys.stderr, flush=True)
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    read_by = time.monotonic() + 5  # a subprocess a rank left behind may hold its pipe open
    for thread in relays:  # the ranks' last lines before this process's own
        thread.join(timeout=max(0.0, read_by - time.monotonic()))
    if stopped:
        print("autodist run: interrupted; the ranks were stopped", file=sys.stderr, flush=True)
        return 128 + stopped[0]
    failures = [failure_of(first + rank, _ErrorFile(os.path.join(workdir, f"{first + rank}.json"), p.returncode,
                                                    ended[rank]))
                for rank, p in enumerate(procs) if p.returncode != 0]
    if not failures:
        return 0
    finished = any(p.returncode == 0 for p in procs) if elastic else procs[0].returncode == 0
    if finished and all(f.exitcode < 0 or f.error is not None for f in failures) and \
            all(p.returncode == 0 for rank, p in enumerate(procs) if first + rank not in {f.rank for f in failures}):
        for f in failures:
            err.show_kept(f.rank)  # what a hidden rank said before it was lost
        lost = ", ".join(f"rank {f.rank} ({f.how}{': ' + f.error if f.error else ''})" for f in failures)
        here = " on this machine" if node.count > 1 else ""
        print(f"autodist run: finished with {nproc - len(failures)} of {nproc} ranks{here}; lost {lost}",
              file=sys.stderr, flush=True)
        return 0
    err.show_kept(root_cause(failures).rank)  # a hidden rank's crash, before the summary
    print("\n".join(summary(failures, nproc)), file=sys.stderr, flush=True)
    return root_cause(failures).status
