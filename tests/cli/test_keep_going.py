"""The launcher of --keep-going and --elastic: what it holds across a restart of every rank."""
from __future__ import annotations

import socket

from autodist.cli import keep_going
from autodist.cli.stragglers import Stragglers


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_fresh_rendezvous_shuts_the_old_stores_server_down():
    """Every rank started again (a job that cannot go on without a lost rank) gets a new store on a new port;
    the old one's server must not stay open for the rest of the job, one more for each such restart."""
    job = object.__new__(keep_going._Job)  # its store and node only: no rank is started
    job.node = keep_going.Node(1, 0, "127.0.0.1", keep_going._free_port())
    job.store = keep_going._Store(job.node.addr, job.node.port, hosts=True)
    job.watch = Stragglers(job.store, 60.0, 60.0)
    ports = [job.node.port]
    for _ in range(3):
        job.fresh_store()
        ports.append(job.node.port)
    assert len(set(ports)) == 4
    assert [_listening(p) for p in ports] == [False, False, False, True]
