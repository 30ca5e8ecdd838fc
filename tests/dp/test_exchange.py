"""How gradient buckets are summed: shared memory between the ranks of one machine, gloo's all-reduce otherwise."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.dp import exchange
from autodist.runtime import environment
from autodist.runtime import shared_memory
from autodist.dp.grad_sync import state_of


def _buckets(sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n, dtype in sizes]


def _contribution(sync: int, bucket: int, n: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * sync + 10 * bucket + rank)
    return torch.randn(n, generator=g, dtype=dtype)


def _expected(sync: int, bucket: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' contributions added in rank order, as the shared-memory sum adds them (made here, without
    a collective, so that nothing but the exchange keeps the ranks in step)."""
    parts = [_contribution(sync, bucket, n, dtype, r) for r in range(dist.get_world_size())]
    total = parts[0] + parts[1]
    for t in parts[2:]:
        total += t
    return total


def _sums(syncs: int, slow_rank: int | None = None) -> tuple[str, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """``syncs`` sums of four buckets (one summed in several pieces); ``slow_rank`` reads each sum 0.3 s late,
    while the others go on: rank 0 clears its buckets in place at once (as clipping gradients would) and packs
    the next sync."""
    sizes = [(1000, torch.float32), (37, torch.float64), (5000, torch.float32), (300_007, torch.float32)]
    ex = exchange.choose(_buckets(sizes), None)
    flats = [ex.place(i, f) for i, f in enumerate(_buckets(sizes))]
    got, want = [], []
    for sync in range(syncs):
        for i, (n, dtype) in enumerate(sizes):
            flats[i].copy_(_contribution(sync, i, n, dtype, dist.get_rank()))
            ex.send(i, flats[i])
        ex.finish()
        if dist.get_rank() == slow_rank:
            time.sleep(0.3)
        got.append([f.clone() for f in flats])
        want.append([_expected(sync, i, n, dtype) for i, (n, dtype) in enumerate(sizes)])
        if dist.get_rank() == 0:
            for f in flats:
                f.zero_()
    return ex.name, got, want


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_sums_equal_the_rank_order_sum_on_every_rank(ranks, size):
    results = ranks(size, _sums, 4)
    for name, got, want in results:
        assert name == "shared memory"
        for g, e in zip(got, want):
            assert_close(g, e, rtol=0, atol=0)
    for _, got, _ in results[1:]:
        assert_close(got, results[0][1], rtol=0, atol=0)  # the same bits on every rank


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_reading_the_sum_late_is_not_disturbed_by_the_others(ranks, size):
    # The last rank reads each sum 0.3 s late, while rank 0 at once zeroes its buckets in place and packs
    # its next contribution: the sum the late rank reads must be neither rank 0's zeros (its slot holds a
    # sum of its own) nor a part of the next sync's sum (written only once every rank has entered that sync).
    for name, got, want in ranks(size, _sums, 3, size - 1):
        assert name == "shared memory"
        for g, e in zip(got, want):
            assert_close(g, e, rtol=0, atol=0)


def _choice_with(env: dict[str, str], free: int | None = None) -> str:
    saved = {k: os.environ.get(k) for k in env}
    saved_free = shared_memory.free_bytes
    os.environ.update(env)
    if free is not None:
        shared_memory.free_bytes = lambda: free
    try:
        return exchange.choose(_buckets([(100_000, torch.float32)]), None).name
    finally:
        shared_memory.free_bytes = saved_free
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _choices() -> list[str]:
    rank = str(dist.get_rank())
    return [_choice_with({"AUTODIST_SHARED_MEMORY": "0"}),
            _choice_with({"GROUP_RANK": rank}),  # the launcher put each rank on a node of its own
            _choice_with({}, free=1000),  # /dev/shm nearly full
            _choice_with({})]


def test_the_all_reduce_where_shared_memory_is_off_or_impossible(ranks):
    for choices in ranks(2, _choices):
        assert choices == ["all-reduce", "all-reduce", "all-reduce", "shared memory"]


def test_nothing_is_left_in_dev_shm(ranks):
    before = set(os.listdir(shared_memory.DIRECTORY))
    ranks(2, _sums, 1)
    assert {f for f in os.listdir(shared_memory.DIRECTORY) if f.startswith("autodist-")} <= before


def _train(shared: str, opt_name: str) -> tuple[str, dict, dict]:
    os.environ["AUTODIST_SHARED_MEMORY"] = shared
    try:
        ref = w.train(w.seeded(w.mlp, 0), w.loader(*w.digits_like(22), 8), opt_name, 3)
        model = w.seeded(w.mlp, 0 if dist.get_rank() == 0 else 7)
        model, data = autodist.parallelize(model, w.loader(*w.digits_like(22), 8))
        used = state_of(model).exchange.name
        return used, w.state(ref), w.state(w.train(model, data, opt_name, 3))
    finally:
        os.environ.pop("AUTODIST_SHARED_MEMORY", None)


@pytest.mark.parametrize("shared,name", [("1", "shared memory"), ("0", "all-reduce")])
def test_training_through_either_exchange_matches_one_process(ranks, shared, name):
    # Adam, 3 ranks, 22 samples in batches of 8: both ways give the single-process parameters.
    results = ranks(3, _train, shared, "adam")
    for used, ref, par in results:
        assert used == name
        assert_close(par, ref, rtol=1e-5, atol=1e-6)
    for _, _, par in results[1:]:
        assert_close(par, results[0][2], rtol=0, atol=0)


def test_environment_switch_and_machine_name():
    assert environment.shared_memory_allowed({}) is True
    assert environment.shared_memory_allowed({"AUTODIST_SHARED_MEMORY": "0"}) is False
    with pytest.raises(ValueError, match="AUTODIST_SHARED_MEMORY='off': give 1"):
        environment.shared_memory_allowed({"AUTODIST_SHARED_MEMORY": "off"})
    assert environment.machine({"GROUP_RANK": "0"}) != environment.machine({"GROUP_RANK": "1"})
    assert environment.machine({"SLURM_NODEID": "3"}).endswith("/node 3")


def test_a_file_of_another_size_or_absent_is_refused():
    path, why = shared_memory.make(4096)
    assert path is not None and why == ""
    try:
        with pytest.raises(OSError, match="not the file made for these ranks"):
            shared_memory.map_file(path, 8192)
        shared_memory.map_file(path, 4096).close()
    finally:
        shared_memory.remove(path)
    with pytest.raises(FileNotFoundError):
        shared_memory.map_file(path, 4096)
    assert shared_memory.make(10**15)[0] is None


def _accumulate(model: torch.nn.Module, loader, no_sync, unfreeze_at: int) -> tuple[torch.nn.Module, list[str]]:
    """SGD over pairs of micro-batches (the first under ``no_sync``); the first layer frozen until step
    ``unfreeze_at`` (a bucket rebuild under parallelize); the exchange in use after every step."""
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches, used = list(loader), []
    for step in range(len(batches) // 2):
        if step == unfreeze_at:
            model[0].weight.requires_grad_(True)
        opt.zero_grad()
        (x1, y1), (x2, y2) = batches[2 * step:2 * step + 2]
        with no_sync():
            torch.nn.functional.cross_entropy(model(x1), y1).backward()
        torch.nn.functional.cross_entropy(model(x2), y2).backward()
        opt.step()
        sync = state_of(model)
        used.append(sync.exchange.name if sync is not None else "")
    return model, used


class InputMean(torch.nn.Module):
    """A running mean of its input, kept in a buffer, as BatchNorm keeps its running_mean; passes the input on."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x


def _buffer_accumulation_rebuild() -> tuple[list[str], dict, dict, int]:
    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(6, 8), InputMean(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()

    x, y = w.digits_like(40)
    data = lambda: w.loader(x.double(), y, 5, shuffle=False)  # noqa: E731 - 8 micro-batches of 5: 4 steps
    ref, _ = _accumulate(w.seeded(build, 0), data(), lambda: torch.enable_grad(), unfreeze_at=2)
    model, shards = autodist.parallelize(w.seeded(build, 0), data())
    model, used = _accumulate(model, shards, lambda: autodist.no_sync(model), unfreeze_at=2)
    rode = state_of(model).buckets[-1].extra.numel()
    return used, w.state(ref), w.state(model), rode


def test_buffers_accumulation_and_a_rebuild_go_through_shared_memory_exactly(ranks):
    # A running-mean buffer (as BatchNorm's running_mean) rides in the last bucket; no_sync
    # accumulates two micro-batches per step; unfreezing the first layer at step 2 rebuilds the buckets
    # and chooses the exchange again. 3 ranks share micro-batches of 5 unevenly (2, 2, 1).
    for used, ref, par, rode in ranks(3, _buffer_accumulation_rebuild):
        assert used == ["shared memory"] * 4
        assert rode > 0
        assert_close(par, ref, rtol=1e-12, atol=1e-12)
