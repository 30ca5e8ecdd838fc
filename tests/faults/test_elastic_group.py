"""The elastic job's process group, made from a store alone through torch's private parts
(autodist.faults.elastic.gloo_group): it must sum on every torch version autodist runs on, or fail here, by name,
rather than in a job that lost a rank. Two real processes, their own store."""
from __future__ import annotations

import multiprocessing
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from autodist.faults.elastic import gloo_group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum(rank: int, port: int, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
        group = gloo_group(dist.PrefixStore("1/group", store), rank, 2, 30.0)
        t = torch.tensor([float(rank + 1)], dtype=torch.float64)
        dist.all_reduce(t, group=group)  # as the elastic sync calls it
        out.put((rank, group.rank(), group.size(), float(t)))
    except Exception as error:  # noqa: BLE001 - a torch that changed its private parts: said by name
        out.put((rank, repr(error)))


def test_a_group_made_from_a_store_sums_over_its_ranks():
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_sum, args=(rank, port, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
