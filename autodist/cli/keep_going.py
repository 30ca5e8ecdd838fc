"""``autodist run --keep-going``: the ranks of one machine outlive a lost peer (parameter-server training).

torchrun stops every rank as soon as one ends badly: right for synchronous
training, where the others cannot go on without it, wrong for asynchronous
parameter-server training (``autodist.Downpour`` / ``autodist.EASGD``), which
drops a lost worker and finishes with the others. With ``--keep-going``,
``autodist run`` starts the ranks itself, with torchrun's environment
variables (the script and autodist see the same world as under torchrun),
waits for every one, and names the ranks it lost. In synchronous training a
lost rank still ends the job: the others' watchdog names it and they stop.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from autodist.cli.launch import failure_of, python_command, root_cause, summary
from autodist.cli.output import LABELLED, Output, RankLines, relay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ErrorFile:
    """What ``failure_of`` reads of torchrun's failure records: the rank's error file and when it ended."""

    def __init__(self, path: str, exitcode: int, when: float) -> None:
        self.error_file, self.exitcode, self.timestamp = path, exitcode, when


def run_each(nproc: int, script: list[str], workdir: str, output: Output = LABELLED) -> int:
    """Run ``nproc`` ranks of ``script`` (the script and its arguments) on this machine; their exit status.

    With ``output`` labelled, the ranks' stdout and stderr are pipes read here, a labelled line at a time
    (see :mod:`autodist.cli.output`); raw, the ranks write to this process's own.

    Returns 0 when every rank that did not die of a signal or an error finished cleanly and rank 0 is among
    them (the lost ranks are named); otherwise the first failure's status, as ``autodist run`` reports it.

    Example:
        >>> run_each(3, ["train_ps.py", "--epochs", "3"], "/tmp/run")
    """
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    procs, relays = [], []
    out, err = RankLines(sys.stdout, output.shown), RankLines(sys.stderr, output.shown)
    pipe = subprocess.PIPE if output.labelled else None
    for rank in range(nproc):
        env = base | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                      "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port), "TORCHELASTIC_ERROR_FILE": os.path.join(workdir, f"{rank}.json")}
        # --loopback-store: rank 0 hosts the store on 127.0.0.1, as under autodist run without --keep-going
        procs.append(subprocess.Popen([*python_command("_rank", unbuffered=True), "--loopback-store", *script],
                                      env=env, stdout=pipe, stderr=pipe))
        if output.labelled:
            relays += [relay(procs[-1].stdout, rank, out), relay(procs[-1].stderr, rank, err)]
    stopped: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if len(stopped) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    ended: dict[int, float] = {}
    try:
        while len(ended) < nproc:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
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
    failures = [failure_of(rank, _ErrorFile(os.path.join(workdir, f"{rank}.json"), p.returncode, ended[rank]))
                for rank, p in enumerate(procs) if p.returncode != 0]
    if not failures:
        return 0
    if procs[0].returncode == 0 and all(f.exitcode < 0 or f.error is not None for f in failures) and \
            all(p.returncode == 0 for rank, p in enumerate(procs) if rank not in {f.rank for f in failures}):
        for f in failures:
            err.show_kept(f.rank)  # what a hidden rank said before it was lost
        lost = ", ".join(f"rank {f.rank} ({f.how}{': ' + f.error if f.error else ''})" for f in failures)
        print(f"autodist run: finished with {nproc - len(failures)} of {nproc} ranks; lost {lost}",
              file=sys.stderr, flush=True)
        return 0
    err.show_kept(root_cause(failures).rank)  # a hidden rank's crash, before the summary
    print("\n".join(summary(failures, nproc)), file=sys.stderr, flush=True)
    return root_cause(failures).status
