"""Data-parallel training equals single-process training on the same global batches."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import workloads as w


def assert_same_training(results: list[tuple[dict, dict]], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for ref, par in results:
        assert_close(par, ref, rtol=rtol, atol=atol)
    for _, par in results[1:]:
        assert_close(par, results[0][1], rtol=0, atol=0)  # every rank holds the very same model


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
