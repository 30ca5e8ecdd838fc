"""shard="gradients" (and "parameters", which shards the gradients the same way): each rank keeps 1/N of the averaged gradients, and everything a loop does with them is
what one process would do - clipping by the global norm, clipping by value, zero_grad(set_to_none=False), a
second backward adding to the gradients - or a clear error; never a silent per-rank answer."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.dp.grad_sync import state_of
from autodist.sharded.scatter import RING, ScatteredBucket


def _pair(**options):
    """The single-process model and the parallelized one (from another seed on ranks > 0), this rank's rows."""
    x, y = w.digits_like(36, features=6, classes=3)
    ref = w.seeded(w.mlp, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(w.mlp, 100 * w.rank()), (x, y), **options)
    n = torch.distributed.get_world_size()
    global_batches = [(x[i:i + 12], y[i:i + 12]) for i in range(0, 36, 12)]
    mine = [(xs[i:i + 12 // n], ys[i:i + 12 // n]) for i in range(0, len(xs), 12 // n)]
    return ref, model, global_batches, mine


@w.float64
def _many_buckets(shared_memory: str):
    os.environ["AUTODIST_SHARED_MEMORY"] = shared_memory
    try:
        ref, model, batches, mine = _pair(shard="gradients", first_bucket_mb=0.0001, bucket_mb=0.0005)
        buckets = state_of(model).buckets
        assert len(buckets) > 2 * RING and all(isinstance(b, ScatteredBucket) for b in buckets)
        for m, data in ((ref, batches), (model, mine)):
            opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            for xb, yb in data * 2:
                opt.zero_grad()
                F.cross_entropy(m(xb), yb).backward()
                opt.step()
        return w.state(ref), w.state(model), state_of(model).exchange.name
    finally:
        del os.environ["AUTODIST_SHARED_MEMORY"]


@pytest.mark.parametrize("shared_memory, exchange", [("1", "shared memory"), ("0", "reduce-scatter")])
def test_many_buckets_through_the_ring_train_as_one_process(ranks, shared_memory, exchange):
    # more buckets than ring buffers: bucket k is packed where bucket k-2 was, every sync
    for ref, par, name in ranks(3, _many_buckets, shared_memory):
        assert name == exchange
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


@w.float64
def _clipping(shard: str):
    ref, model, batches, mine = _pair(shard=shard, bucket_mb=0.002, first_bucket_mb=0.001)
    norms = {}
    for m, data in ((ref, batches), (model, mine)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        seen = norms.setdefault(id(m), [])
        for step, (order, (xb, yb)) in enumerate(zip([2.0, 1.0, math.inf, 3.0, -math.inf, 2.0], data * 2)):
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            if step == 5:
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
                seen.append(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
            else:
                seen.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=order))
            opt.step()
    return w.state(ref), w.state(model), norms[id(ref)], norms[id(model)]


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_clip_grad_norm_sees_the_global_norm_of_every_order_and_clip_grad_value_the_global_gradient(ranks, shard):
    for ref, par, ref_norms, norms in ranks(3, _clipping, shard):
        assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-12, atol=0)
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


@w.float64
def _adding(set_to_none: bool, shard: str):
    """Two backwards per step, each synced (no no_sync), with zero_grad(set_to_none) between steps: the second
    adds to the first's sharded gradient, as autograd adds in one process."""
    ref, model, batches, mine = _pair(shard=shard)
    for m, data in ((ref, batches), (model, mine)):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for xb, yb in data:
            opt.zero_grad(set_to_none=set_to_none)
            half = len(xb) // 2
            F.cross_entropy(m(xb[:half]), yb[:half]).backward()
            F.cross_entropy(m(xb[half:]), yb[half:]).backward()
            opt.step()
    return w.state(ref), w.state(model)


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_second_backward_adds_to_the_sharded_gradient(ranks, set_to_none, shard):
    for ref, par in ranks(2, _adding, set_to_none, shard):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


@w.float64
def _manual(shard: str):
    ref, model, batches, mine = _pair(shard=shard, sync="manual")
    for m, data in ((ref, batches), (model, mine)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for xb, yb in data:
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            if m is model:
                autodist.synchronize_model(model)
            opt.step()
    return w.state(ref), w.state(model)


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_sync_manual_with_synchronize_model(ranks, shard):
    for ref, par in ranks(2, _manual, shard):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


def _refusals():
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0), shard="gradients")
    F.cross_entropy(model(torch.ones(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
    grad = next(model.parameters()).grad
    messages = {"type": type(grad).__name__, "repr": repr(grad)}
    attempts = {"sum": lambda: grad.sum(), "add": lambda: grad + 1, "clone": lambda: grad.clone(),
                "item of a norm": lambda: grad.norm().item(), "norm over a dim": lambda: grad.norm(dim=0),
                "norm of order 0": lambda: torch.linalg.vector_norm(grad, 0)}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except RuntimeError as e:
            messages[name] = str(e)
    return messages


def test_what_would_see_one_nth_of_a_gradient_raises_naming_what_works(ranks):
    for messages in ranks(2, _refusals):
        assert messages["type"] == "ShardedGrad" and "shard='gradients'" in messages["repr"]
        for name in ("sum", "add", "clone"):
            assert "would see 1/N of it" in messages[name] and "clip_grad_norm_" in messages[name], name
            assert "shard='optimizer'" in messages[name], name
        assert "get_total_norm" in messages["item of a norm"]
        assert "over all its elements only" in messages["norm over a dim"]
        assert "order 0" in messages["norm of order 0"]


def _held():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    model, _ = autodist.parallelize(model, shard="gradients", first_bucket_mb=0.02, bucket_mb=0.02)
    model(torch.ones(4, 64)).sum().backward()
    sync = state_of(model)
    parts = sum(b.part.numel() * b.part.element_size() for b in sync.buckets)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    slices = sum(p.grad.local.numel() for p in model.parameters())
    return parts, whole, slices, len(sync.buckets), [type(p.grad).__name__ for p in model.parameters()]


def test_a_rank_holds_one_nth_of_the_gradients_after_backward(ranks):
    for parts, whole, slices, buckets, types in ranks(2, _held):
        assert set(types) == {"ShardedGrad"}  # no storage of their own: autograd's gradients were freed
        assert parts <= whole / 2 + 4 * buckets, (parts, whole)
        assert slices * 4 <= parts



class _Counting(torch.nn.Module):
    """Linear layers and a float buffer that every forward changes alike on every rank (it rides in the last
    bucket, as BatchNorm's statistics do)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 40), torch.nn.Linear(40, 40), torch.nn.Linear(40, 3)])
        self.register_buffer("calls", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layers[2](torch.tanh(self.layers[1](torch.tanh(self.layers[0](x)))))


@w.float64
def _windowed(shard: str, shared_memory: str):
    """Every bucket larger than the ring's buffers (bucket_mb: 630 bytes), so each is packed and summed window
    by window (in shared memory, or each window one reduce-scatter of the backend's), the last window partly
    full and carrying the count, the flags and a buffer; two micro-batches of uneven sizes per step through
    no_sync: one process's parameters and buffers."""
    os.environ["AUTODIST_SHARED_MEMORY"] = shared_memory
    try:
        return _windowed_run(shard)
    finally:
        del os.environ["AUTODIST_SHARED_MEMORY"]


def _windowed_run(shard: str):
    x, y = w.digits_like(48, features=6, classes=3)
    ref = w.seeded(_Counting, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(_Counting, 100 * w.rank()), (x, y), shard=shard,
                                           first_bucket_mb=0.0003, bucket_mb=0.0006)
    n = torch.distributed.get_world_size()
    buckets = state_of(model).buckets
    for m, (xd, yd) in ((ref, (x, y)), (model, (xs, ys))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        size = 12 if m is ref else 12 // n
        for i in range(0, len(xd), size):
            xb, yb = xd[i:i + size], yd[i:i + size]
            half = len(xb) // 4  # micro-batches of 3 and 9 global rows (each rank's strided share: 1 and 3)
            opt.zero_grad()
            with autodist.no_sync(m):
                F.cross_entropy(m(xb[:half]), yb[:half]).backward()
            F.cross_entropy(m(xb[half:]), yb[half:]).backward()
            opt.step()
    windows = [len(b.windows()) for b in buckets if b.window is not None]
    exchange = state_of(model).exchange
    ring = [slot.numel() for slot in exchange.ring[0]] if exchange.name == "shared memory" else \
        [buffer.numel() for buffer in exchange.ring]
    return w.state(ref), model.state_dict(), windows, ring, len(buckets)


@pytest.mark.parametrize("shared_memory", ["1", "0"])
@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_buckets_larger_than_the_ring_are_summed_window_by_window(ranks, shard, shared_memory):
    """The same through shared memory (1) and through the backend's reduce-scatter (0, as across machines): a
    bucket larger than the ring (a block, a large parameter) never makes a buffer of its size."""
    for ref, par, windows, ring, count in ranks(3, _windowed, shard, shared_memory):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)
        assert windows and max(windows) >= 3, windows  # several windows to a bucket
        assert max(ring) <= 0.0006 * 2**20 / 8 + 8, ring  # a buffer of the ring holds a bucket's cap, no more
