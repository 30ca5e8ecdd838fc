"""The MP layers' all-reduce through shared memory between the ranks of one machine: exact, grown, and declined."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from autodist.layers import shared_reduce


def _value(call: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * call + rank), dtype=dtype)


def _rank_order_sum(call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    total = _value(call, 0, n, dtype)
    for r in range(1, dist.get_world_size()):
        total = total + _value(call, r, n, dtype)
    return total


# sizes: one piece, several pieces, and past the first slots (4 MiB), which then grow
CALLS = [(1000, torch.float32), (300_001, torch.float64), (3_000_000, torch.float32), (17, torch.float32)]


def _sums(slow_rank: int | None) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every call of CALLS, summed by shared_reduce; ``slow_rank`` reads each result 0.2 s late while the others
    go on to the next all-reduce and overwrite their own slots."""
    out = []
    for call, (n, dtype) in enumerate(CALLS):
        t = _value(call, dist.get_rank(), n, dtype).reshape(-1, 1)
        shared_reduce.all_reduce(t, None)
        if dist.get_rank() == slow_rank:
            time.sleep(0.2)
        out.append((t.reshape(-1).clone(), _rank_order_sum(call, n, dtype),
                    shared_reduce.reducer_of(None) is not None))
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_the_sum_is_the_rank_order_sum_on_every_rank_and_shared(ranks, size):
    results = ranks(size, _sums, size - 1)
    for per_rank in results:
        for got, want, shared in per_rank:
            assert shared, "the ranks of one machine should all-reduce through shared memory"
            assert_close(got, want, rtol=0, atol=0)
    for per_rank in results[1:]:
        for (got, _, _), (first, _, _) in zip(per_rank, results[0]):
            assert_close(got, first, rtol=0, atol=0)  # the same bits on every rank


def _grown() -> int:
    return shared_reduce.reducer_of(None).capacity


def test_the_slots_grow_to_the_largest_tensor(ranks):
    ranks(2, _sums, None)
    for capacity in ranks(2, _grown):
        assert capacity >= 3_000_000 * 4


def _declined() -> tuple[bool, list[float], list[int]]:
    """A new group with AUTODIST_SHARED_MEMORY=0 goes through gloo; an integer tensor always does."""
    os.environ["AUTODIST_SHARED_MEMORY"] = "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        t = torch.full((5,), float(dist.get_rank() + 1))
        shared_reduce.all_reduce(t, group)
    finally:
        del os.environ["AUTODIST_SHARED_MEMORY"]
    whole = torch.full((3,), dist.get_rank() + 1)
    shared_reduce.all_reduce(whole, None)
    return shared_reduce._chosen["activations"][group] is None, t.tolist(), whole.tolist()


def test_turned_off_or_not_floating_point_it_is_the_backends_all_reduce(ranks):
    for declined, summed, whole in ranks(2, _declined):
        assert declined
        assert summed == [3.0] * 5 and whole == [3] * 3
