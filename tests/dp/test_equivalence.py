"""Data-parallel training equals single-process training on the same global batches."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import workloads as w
from alike import assert_same_training


def _mlp_run(opt_name: str, n: int, batch: int, epochs: int):
    return w.reference_and_parallel(w.mlp, lambda: w.loader(*w.digits_like(n), batch), opt_name, epochs)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_mlp_uneven_batches_matches_one_process(ranks, size, opt_name):
    # 22 samples, batch 8: global batches of 8, 8, 6 split unevenly over 3 ranks.
    assert_same_training(ranks(size, _mlp_run, opt_name, 22, 8, 4))


def test_last_global_batch_smaller_than_ranks_gives_no_nan(ranks):
    # 17 samples, batch 8 -> last global batch of 1: two of three ranks get an empty batch.
    results = ranks(3, _mlp_run, "adam", 17, 8, 3)
    assert_same_training(results)
    assert all(torch.isfinite(t).all() for t in results[0][1].values())


def _cnn_data(n: int = 20):
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return w.loader(x, y, batch=10, shuffle=False)


def _cnn_one_step(shard: str | None = None):
    return w.reference_and_parallel(w.TinyCNN, lambda: _cnn_data(10), "sgd", epochs=1, shard=shard)


def _cnn_train_and_eval(frozen_bn: bool, batch_norm: str = "global"):
    def build():
        model = w.TinyCNN()
        if frozen_bn:  # fine-tuning: BatchNorm uses its running statistics, no batch statistics
            model.bn.eval()
        return model
    # SGD, not Adam: one conv-weight gradient here is a near-cancellation (4e-7 from terms of 1e-2),
    # and Adam, which divides by the gradient's own size, turns its last-bit rounding (any change of
    # summation order does this, a second process or not) into a 5e-5 relative difference.
    return w.reference_and_parallel(build, _cnn_data, "sgd", epochs=3, batch_norm=batch_norm)


@pytest.mark.parametrize("shard", [None, "gradients", "parameters"])
def test_batchnorm_running_mean_is_global_and_ranks_agree(ranks, shard):
    # One step of 10 samples, 5 per rank: the running mean is a linear update, so averaging
    # the ranks' updates weighted by samples gives exactly the single-process running mean.
    # shard="gradients": the statistics ride in the reduce-scattered buckets' summed extra slots.
    results = ranks(2, _cnn_one_step, shard)
    for ref, par in results:
        assert_close(par["bn.running_mean"], ref["bn.running_mean"], rtol=1e-5, atol=1e-7)
        assert par["bn.num_batches_tracked"] == ref["bn.num_batches_tracked"]
    assert_close(results[1][1], results[0][1], rtol=0, atol=0)


def test_batchnorm_with_local_statistics_drifts_from_one_process(ranks):
    # batch_norm="local": in train mode each rank normalizes by its own batch's statistics (as DDP does), so
    # parameters drift from the single-process run, yet all ranks keep identical parameters and buffers.
    # The default, the global batch's statistics, is one process's: tests/dp/test_batch_norm.py.
    results = ranks(2, _cnn_train_and_eval, False, "local")
    ref, par = results[0]
    assert not torch.allclose(par["conv.weight"], ref["conv.weight"], rtol=1e-5, atol=1e-6)
    assert_close(results[1][1], par, rtol=0, atol=0)


def test_batchnorm_in_training_is_one_process(ranks):
    for ref, par in ranks(2, _cnn_train_and_eval, False):
        assert_close(par, ref, rtol=1e-5, atol=1e-6)


def test_frozen_batchnorm_matches_one_process(ranks):
    assert_same_training(ranks(2, _cnn_train_and_eval, True))


def _tied_data():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (26,), generator=g)
    return w.loader(tokens, (tokens + 1) % 11, batch=6)


def _tied_run():
    return w.reference_and_parallel(w.TiedLM, _tied_data, "adam", epochs=3)


def test_tied_weights(ranks):
    results = ranks(2, _tied_run)
    assert_same_training(results)
    assert "out.weight" in results[0][1]


def _unused_data():
    x, y = w.digits_like(24)
    return w.loader(x, y, batch=4)


def _unused_run(opt_name: str):
    return w.reference_and_parallel(w.SometimesUsed, _unused_data, opt_name, epochs=3)


@pytest.mark.parametrize("size", [2, 3])
def test_parameters_unused_on_some_ranks_or_all(ranks, size):
    # `extra` runs on some ranks in some steps; `never` never runs: AdamW decays any
    # parameter holding a gradient, so a zero gradient instead of None would move it.
    results = ranks(size, _unused_run, "adamw")
    assert_same_training(results)
    for ref, par in results:
        assert_close(par["never.weight"], ref["never.weight"], rtol=0, atol=0)
