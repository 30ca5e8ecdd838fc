"""autodist.comm: collectives on tensors and lists, in place or not, sync or with handles, over named communicators."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from autodist import comm


def _reductions():
    r = comm.world().rank
    a, b = torch.full((3,), float(r + 1)), torch.arange(4.0) * (r + 1)
    out = comm.all_reduce(a, inplace=False)  # a is left alone
    mine = a.clone()
    comm.all_reduce([a, b], "mean")  # in place, both
    h = comm.all_reduce(torch.tensor([float(r)]), async_op=True)
    total = h.wait()
    return mine, out, a, b, total, h.is_completed()


def test_all_reduce_sum_mean_in_and_out_of_place_sync_and_async(ranks):
    results = ranks(3, _reductions)
    for r, (mine, out, a, b, total, done) in enumerate(results):
        assert_close(mine, torch.full((3,), float(r + 1)))  # out of place did not touch the input
        assert_close(out, torch.full((3,), 6.0))  # 1 + 2 + 3
        assert_close(a, torch.full((3,), 2.0))
        assert_close(b, torch.arange(4.0) * 2.0)
        assert_close(total, torch.tensor([3.0]))
        assert done


def _gathers():
    c = comm.world()
    r = c.rank
    gathered = comm.all_gather(torch.tensor([r, 10 * r]))
    pair = comm.all_gather([torch.tensor([float(r)]), torch.tensor([r > 0])], async_op=True).wait()
    scattered = comm.reduce_scatter(torch.arange(6.0) + r)  # sum over ranks, then member i takes chunk i
    mean = comm.reduce_scatter([torch.arange(3.0) * (r + 1)], "mean")
    copy = torch.full((2,), float(r))
    comm.broadcast(copy, src=2)
    fresh = comm.broadcast([torch.full((2,), float(r))], src=1, inplace=False)
    return gathered, pair, scattered, mean, copy, fresh


def test_all_gather_reduce_scatter_broadcast(ranks):
    results = ranks(3, _gathers)
    for r, (gathered, pair, scattered, mean, copy, fresh) in enumerate(results):
        assert [t.tolist() for t in gathered] == [[0, 0], [1, 10], [2, 20]]
        assert [t.item() for t in pair[0]] == [0.0, 1.0, 2.0] and [t.item() for t in pair[1]] == [False, True, True]
        assert_close(scattered, (torch.arange(6.0) * 3 + 3).chunk(3)[r])
        assert_close(mean[0], (torch.arange(3.0) * 2).chunk(3)[r])
        assert_close(copy, torch.full((2,), 2.0))
        assert_close(fresh[0], torch.full((2,), 1.0))


def _ring():
    c = comm.world()
    r, p = c.rank, c.size
    out = comm.send([torch.full((2,), float(r)), torch.tensor([r])], dst=(r + 1) % p, async_op=True)
    buf = [torch.empty(2), torch.empty(1, dtype=torch.long)]
    got = comm.recv(buf, src=(r - 1) % p, async_op=True)
    received = got.wait()
    out.wait()
    return received[0].tolist(), received[1].item(), received[0] is buf[0]


def test_send_recv_ring_with_handles(ranks):
    for r, (values, tag, in_place) in enumerate(ranks(3, _ring)):
        assert values == [float((r - 1) % 3)] * 2 and tag == (r - 1) % 3 and in_place


def _named():
    node, across = comm.host(ranks_per_host=2), comm.across_hosts(ranks_per_host=2)
    pair = comm.custom([3, 0], name="ends")
    r = comm.world().rank
    on_host = comm.all_reduce(torch.tensor([float(r)]), comm=node, inplace=False)
    between = comm.all_reduce(torch.tensor([float(r)]), comm=across, inplace=False)
    first_of_pair = comm.broadcast(torch.tensor([float(r)]), src=0, comm=pair) if pair.rank is not None else None
    outside = None
    if pair.rank is None:
        try:
            comm.all_reduce(torch.zeros(1), comm=pair)
        except ValueError as e:
            outside = str(e)
    return (node.name, node.ranks, across.ranks, on_host.item(), between.item(), first_of_pair, outside,
            comm.host(ranks_per_host=2) is node)


def test_named_communicators(ranks):
    results = ranks(4, _named)
    for r, (name, host_ranks, across_ranks, on_host, between, first, outside, same) in enumerate(results):
        assert name == f"host {r // 2}" and host_ranks == (2 * (r // 2), 2 * (r // 2) + 1)
        assert across_ranks == (r % 2, r % 2 + 2)
        assert on_host == sum(host_ranks) and between == sum(across_ranks)
        if r in (0, 3):
            assert first.item() == 3.0  # member 0 of [3, 0] is rank 3
        else:
            assert "not in communicator 'ends'" in outside
        assert same  # asking again gives the same communicator, counter included


def _bytes():
    c = comm.custom([0, 1], name="counted")
    comm.all_reduce(torch.zeros(100), comm=c)  # ring: 2 (P-1)/P of 400 bytes
    comm.all_gather(torch.zeros(10), comm=c)  # (P-1) x 40
    comm.broadcast(torch.zeros(10), src=0, comm=c)  # 40 from member 0 only
    return c.bytes_sent


def test_bytes_sent_counter(ranks):
    assert ranks(2, _bytes) == [400 + 40 + 40, 400 + 40]


def _errors():
    c = comm.world()
    messages = []
    for call in (lambda: comm.all_reduce(torch.zeros(1), "max"),
                 lambda: comm.reduce_scatter(torch.zeros(3)),
                 lambda: comm.send(torch.zeros(1), dst=c.rank),
                 lambda: comm.broadcast(torch.zeros(1), src=5),
                 lambda: comm.all_reduce([torch.zeros(1), 3.0]),
                 lambda: comm.custom([0, 0]),
                 lambda: comm.host(ranks_per_host=3)):
        try:
            call()
            messages.append(None)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_errors_say_what_was_wrong(ranks):
    messages = ranks(2, _errors)[0]
    assert None not in messages, messages
    assert "'sum' or 'mean'" in messages[0]
    assert "2 equal chunks" in messages[1]
    assert "cannot send to itself" in messages[2]
    assert "has 2 members" in messages[3]
    assert "holding float" in messages[4]
    assert "distinct world ranks" in messages[5]
    assert "dividing the 2 ranks" in messages[6]


def test_world_of_one_returns_unchanged():
    t = torch.arange(4.0)
    assert comm.all_reduce(t, "mean") is t and t.tolist() == [0, 1, 2, 3]
    assert comm.all_gather(t)[0].tolist() == [0, 1, 2, 3]
    assert comm.reduce_scatter(t, async_op=True).wait().tolist() == [0, 1, 2, 3]
    assert comm.world().size == 1 and comm.host().size == 1


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_handle_wait_twice_returns_the_same(op):
    h = getattr(comm, op)(torch.ones(2), async_op=True)
    assert h.wait() is h.wait()
