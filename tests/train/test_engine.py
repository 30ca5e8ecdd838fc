"""Training-loop helpers: prefetch, exact metrics and evaluation across ranks, progress and logs."""
from __future__ import annotations

import collections
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import autodist
import workloads as w
from autodist import engine

# -- shared pieces ---------------------------------------------------------------------------------


def _mp_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _test_set(n: int) -> TensorDataset:
    return TensorDataset(*w.digits_like(n, features=6, classes=3, seed=11))


def _reference(model: nn.Module, dataset: TensorDataset) -> dict:
    """The whole test set through the model at once, in one process."""
    x, y = dataset.tensors
    with torch.no_grad():
        out = model(x)
    correct = int((out.argmax(1) == y).sum())
    return {"loss": float(F.cross_entropy(out, y)), "count": len(y), "correct": correct,
            "accuracy": 100.0 * correct / len(y)}


def _assert_same_numbers(got: dict, expected: dict) -> None:
    assert got["count"] == expected["count"] and got["correct"] == expected["correct"]
    assert got["accuracy"] == expected["accuracy"]
    assert_close(got["loss"], expected["loss"], rtol=0, atol=1e-6)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "autodist-prefetch"]


def _no_prefetch_thread_left(within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _prefetch_threads()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# -- prefetch (one process) ------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "x y")


def test_prefetch_keeps_order_and_identity():
    items = [torch.randn(2), {"a": torch.zeros(1)}, "text", Pair(torch.ones(1), 3)] * 5
    got = list(engine.prefetch(items, depth=3))
    assert len(got) == len(items) and all(a is b for a, b in zip(got, items))
    assert len(engine.prefetch(items)) == len(items)
    assert _no_prefetch_thread_left()


def test_prefetch_moves_nested_tensors_to_the_device():
    batch = (torch.zeros(2), [torch.ones(3), {"k": torch.arange(2)}], Pair(torch.ones(1), "label"), 7)
    (moved,) = list(engine.prefetch([batch], device="meta"))
    assert type(moved) is tuple and type(moved[1]) is list and type(moved[2]) is Pair
    tensors = [moved[0], moved[1][0], moved[1][1]["k"], moved[2].x]
    assert all(t.device.type == "meta" for t in tensors)
    assert [t.shape for t in tensors] == [(2,), (3,), (2,), (1,)]
    assert moved[2].y == "label" and moved[3] == 7


def test_prefetch_reraises_the_producers_exception_at_its_batch():
    def batches():
        yield 0
        yield 1
        raise KeyError("sample 2 is missing")

    seen = []
    with pytest.raises(KeyError, match="sample 2 is missing"):
        for item in engine.prefetch(batches()):
            seen.append(item)
    assert seen == [0, 1] and _no_prefetch_thread_left()


@pytest.mark.parametrize("how", ["break", "close", "with"])
def test_prefetch_stops_its_thread_when_the_consumer_stops_early(how):
    produced, closed = [], []

    def endless():
        try:
            i = 0
            while True:
                produced.append(i)
                yield i
                i += 1
        finally:
            closed.append(True)

    if how == "break":
        for i in engine.prefetch(endless(), depth=2):
            if i == 3:
                break
    elif how == "close":
        batches = engine.prefetch(endless(), depth=2)
        assert [next(batches) for _ in range(4)] == [0, 1, 2, 3]
        batches.close()
        assert list(batches) == []
    else:
        with engine.prefetch(endless(), depth=2) as batches:
            assert next(batches) == 0
    assert _no_prefetch_thread_left()
    assert closed == [True]  # the generator source ran its cleanup
    assert len(produced) <= 4 + 2 + 1  # consumed, queued, and the one the thread held


def test_prefetch_overlaps_fetching_with_the_step():
    def slow(n: int):
        for i in range(n):
            time.sleep(0.05)
            yield i

    start = time.perf_counter()
    for _ in engine.prefetch(slow(8)):
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.7, f"8 fetches and 8 steps of 50 ms each took {elapsed:.2f} s: no overlap (serial: 0.8 s)"


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_prefetch_rejects_a_bad_depth(depth):
    with pytest.raises(ValueError, match="depth must be a positive int"):
        engine.prefetch([1], depth=depth)


# -- metrics, evaluate, summaries (one process) ----------------------------------------------------

def test_metrics_in_one_process():
    m = engine.Metrics()
    m.update(torch.tensor(3.0), torch.tensor(2), 4)
    m.update(1.5, 1, 2)
    m.update(torch.tensor(float("nan")), 0, 0)  # an empty batch's mean loss x 0: ignored
    assert m.reduce() == {"loss": 4.5 / 6, "accuracy": 50.0, "count": 6, "correct": 3}
    assert m.reduce()["count"] == 6  # reduce keeps the sums
    m.reset()
    empty = m.reduce()
    assert empty["count"] == 0 and empty["loss"] != empty["loss"]  # NaN: nothing seen


@pytest.mark.parametrize("args, error, words", [
    ((torch.ones(4), 1, 4), ValueError, "sum it first"),
    ((1.0, 1, 2.0), TypeError, "count must be an int"),
    ((1.0, 1, -1), ValueError, "count must be >= 0"),
])
def test_metrics_update_rejects_what_is_not_a_sum(args, error, words):
    with pytest.raises(error, match=words):
        engine.Metrics().update(*args)


def test_evaluate_plain_model_in_a_world_of_one_restores_modes():
    model, data = w.seeded(_mp_net, 0), _test_set(23)
    model.train()
    model[1].eval()  # a mixed state must come back as it was
    got = engine.evaluate(model, data, batch_size=5)
    _assert_same_numbers(got, _reference(model, data))
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_errors():
    with pytest.raises(TypeError, match="Expect nn.Module for model, str found"):
        engine.evaluate("model", _test_set(4))
    with pytest.raises(ValueError, match=r"\(input, target\) pairs"):
        engine.evaluate(_mp_net(), TensorDataset(torch.zeros(4, 6)))


def test_epoch_summary_line():
    train, test = {"loss": 0.41234, "accuracy": 88.1, "count": 10}, {"loss": 0.45, "accuracy": 87.22}
    assert engine.epoch_summary(3, train, test, 1.234) == \
        "epoch 3 | train loss 0.4123 acc 88.10% | test loss 0.4500 acc 87.22% | 1.23 s"
    assert engine.epoch_summary(1, {"loss": 2.0}, None, 0.5) == "epoch 1 | train loss 2.0000 | 0.50 s"
    with pytest.raises(ValueError, match="'loss' and/or 'accuracy'"):
        engine.epoch_summary(1, {"count": 3}, None, 0.5)


def test_progress_and_logger_in_a_world_of_one():
    tqdm = pytest.importorskip("tqdm")
    items = [1, 2, 3]
    bar = engine.progress(items, desc="epoch 1", disable=False, leave=False)
    assert isinstance(bar, tqdm.tqdm) and list(bar) == items
    assert engine.progress(items, disable=True) is items
    assert _logged_lines() == (["[rank 0/1] hello 7"], ["[rank 0/1] epoch 2 | train loss 1.0000 | 0.10 s"])


# -- on real ranks ---------------------------------------------------------------------------------

def _per_sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.rand(n, generator=g, dtype=torch.float64) * 3, torch.rand(n, generator=g) > 0.4


def _metrics_on_strided_shards(n: int, batch: int) -> dict:
    """Each rank sums its strided share of n per-sample losses in batches, tensors and numbers mixed."""
    losses, right = _per_sample(n)
    rank, size = dist.get_rank(), dist.get_world_size()
    mine_loss, mine_right = losses[rank::size], right[rank::size]
    m = engine.Metrics()
    for i, lo in enumerate(range(0, len(mine_loss), batch)):
        l, r = mine_loss[lo:lo + batch], mine_right[lo:lo + batch]
        if i % 2:
            m.update(float(l.sum()), int(r.sum()), len(l))
        else:
            m.update(l.sum().float(), r.sum(), len(l))
    m.update(float("nan"), 0, 0)  # an empty last batch
    return m.reduce()


@pytest.mark.parametrize("size, n", [(3, 17), (3, 2), (2, 17)])
def test_metrics_are_exact_with_uneven_and_empty_shards(ranks, size, n):
    losses, right = _per_sample(n)
    results = ranks(size, _metrics_on_strided_shards, n, 4)
    assert all(r == results[0] for r in results)  # every rank, the same numbers
    got = results[0]
    assert got["count"] == n and got["correct"] == int(right.sum())
    assert_close(got["loss"], float(losses.mean()), rtol=0, atol=1e-6)
    assert got["accuracy"] == 100.0 * int(right.sum()) / n


def _mp_metrics_and_evaluate(n: int) -> tuple[dict, dict, dict, dict]:
    """mp=2 on 2 ranks (one data-parallel rank): both ranks see every sample, which counts once."""
    data = _test_set(n)
    reference = _reference(w.seeded(_mp_net, 0), data)
    model, _ = autodist.parallelize(w.seeded(_mp_net, 0 if dist.get_rank() == 0 else 5), mp=2)
    x, y = data.tensors
    m = engine.Metrics()
    with torch.no_grad():
        out = model(x)
    m.update(F.cross_entropy(out, y, reduction="sum"), (out.argmax(1) == y).sum(), len(y))
    return reference, m.reduce(model), m.reduce(), engine.evaluate(model, data, batch_size=4)


def test_model_parallel_ranks_count_each_sample_once(ranks):
    for reference, by_model, by_world, evaluated in ranks(2, _mp_metrics_and_evaluate, 13):
        _assert_same_numbers(by_model, reference)
        _assert_same_numbers(evaluated, reference)
        assert by_world["count"] == 2 * reference["count"]  # what passing the model avoids


def _evaluate_parallel(n: int, mp: int) -> tuple[dict, dict, list[bool]]:
    data = _test_set(n)
    reference = _reference(w.seeded(_mp_net, 0), data)
    model, _ = autodist.parallelize(w.seeded(_mp_net, 0 if dist.get_rank() == 0 else 5), mp=mp)
    model.train()
    got = engine.evaluate(model, data, batch_size=4)
    return reference, got, [m.training for m in model.modules()]


@pytest.mark.parametrize("size, mp, n", [(2, 1, 23), (3, 1, 23), (3, 1, 2), (4, 2, 23)])
def test_evaluate_equals_one_process_on_the_whole_test_set(ranks, size, mp, n):
    # 23 divides by none of the data-parallel sizes; 2 samples on 3 ranks leave one rank with none
    results = ranks(size, _evaluate_parallel, n, mp)
    assert all(got == results[0][1] for _, got, _ in results)
    for reference, got, modes in results:
        _assert_same_numbers(got, reference)
        assert all(modes)  # back in training mode


def _logged_lines() -> tuple[list[str], list[str]]:
    capture = _Capture()
    logger = logging.getLogger("autodist.train")
    logger.addHandler(capture)
    try:
        engine.rank_logger().info("hello %d", 7)
        ranked = list(capture.lines)
        engine.log_epoch(2, {"loss": 1.0}, None, 0.1)
        return ranked, capture.lines[len(ranked):]
    finally:
        logger.removeHandler(capture)


def _progress_kinds() -> tuple[str, bool, bool]:
    items = [1, 2, 3]
    bar = engine.progress(items, total=3, desc="train")
    kind = type(bar).__name__
    same = list(bar) == items
    return kind, bar is items, same and engine.progress(items, disable=True) is items


def test_progress_bar_and_log_lines_by_rank(ranks):
    pytest.importorskip("tqdm")
    kinds = ranks(3, _progress_kinds)
    assert kinds == [("tqdm", False, True), ("list", True, True), ("list", True, True)]
    lines = ranks(3, _logged_lines)
    assert [ranked for ranked, _ in lines] == [[f"[rank {r}/3] hello 7"] for r in range(3)]
    assert [epoch for _, epoch in lines] == [["[rank 0/3] epoch 2 | train loss 1.0000 | 0.10 s"], [], []]
