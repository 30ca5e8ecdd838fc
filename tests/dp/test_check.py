"""``parallelize(..., check=loss)``: rank 0 compares a step's gradient with one process's on its global batch.

Silent on a run autodist keeps exact (a mean over tokens, BatchNorm); loud, on every rank, where the loss couples
the batch in a way autodist cannot read (a statistic over the batch, negatives from the rank's own rows), and
for DDP's per-rank BatchNorm statistics: the message names the parameter and the likely cause.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from workloads import float64, seeded


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(23, 6, generator=g), torch.randint(0, 3, (23,), generator=g)
    y[::4] = -100  # labels left out: a mean over the others
    return DataLoader(TensorDataset(x, y), batch_size=10)  # 10, 10, 3: split 5 + 5 and 2 + 1


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _token_mean(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _centered(model: nn.Module, batch) -> torch.Tensor:
    """A loss autodist cannot read: each output against the batch's mean output."""
    out = model(batch[0])
    return F.cross_entropy(out, batch[1]) + ((out - out.mean(0)) ** 2).mean()


LOSSES = {"token_mean": _token_mean, "centered": _centered}


@float64
def _checked(loss: str, options: dict) -> tuple[str | None, list[str]]:
    """(the error the check raised, or None; the log lines) over a whole epoch, checked every step."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        model, loader = autodist.parallelize(seeded(_net, 0), _data(),
                                             check=autodist.Check(LOSSES[loss], every=1), **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in loader:
            optimizer.zero_grad()
            LOSSES[loss](model, batch).backward()
            optimizer.step()
    except RuntimeError as error:
        return str(error), [r.getMessage() for r in records]
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return None, [r.getMessage() for r in records]


def test_the_check_is_silent_on_an_exact_run(ranks):
    results = ranks(2, _checked, "token_mean", {})
    assert [error for error, _ in results] == [None, None]
    assert sum("gradient is one process's" in line for line in results[0][1]) == 3  # every step, on rank 0


def test_the_check_names_a_loss_it_cannot_read(ranks):
    for error, _ in ranks(2, _checked, "centered", {}):
        assert error is not None and "at step 0" in error and "couples the batch" in error, error
        assert "terms ending in MeanBackward0" in error  # what the reading saw and could not count


def test_the_check_names_per_rank_batch_norm(ranks):
    for error, _ in ranks(2, _checked, "token_mean", {"batch_norm": "local"}):
        assert error is not None and "batch_norm='local'" in error, error


def test_the_check_runs_where_whole_gradients_are_on_rank_0():
    with pytest.raises(ValueError, match="check= compares"):
        autodist.api._check_the_check(_token_mean, 2, 1, None, autodist.sync.Exact())
    with pytest.raises(TypeError, match="callable"):
        autodist.Check(3)
