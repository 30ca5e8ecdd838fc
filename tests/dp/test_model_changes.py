"""A model changed after parallelize: parameters it never saw are refused loudly, other registrations are not.

A head added (or a weight replaced) after ``parallelize`` would train on each rank alone: nothing
synchronizes it. Exact sync refuses it at the next forward, the low-communication modes at the next
optimizer step, on every rank, naming the parameters. Registrations elsewhere (another model built for
evaluation, a buffer a module makes in its forward) change nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autodist
import workloads as w


def _train_after(change, sync):
    x, y = w.digits_like(16)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=sync)
    change(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for xb, yb in data:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    except autodist.ModelChanged as error:
        return str(error)
    return None


def _add_head(model):
    torch.manual_seed(autodist.rank())  # a different head on every rank, as a real script could make
    model.add_module("head", nn.Linear(3, 3))


def _replace_weight(model):
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())


def _build_another_model(model):
    nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))  # registrations outside the parallelized model


class _CachesInForward(nn.Module):
    """Registers a buffer during its forward, as some rotary-embedding caches do."""

    def forward(self, x):
        self.register_buffer("cache", torch.ones(1), persistent=False)
        return x


def _buffer_made_in_forward(model):
    model.add_module("cache", _CachesInForward())  # no parameter: allowed, and the buffer is seen


@pytest.mark.parametrize("change, refused", [(_add_head, "head.weight, head.bias"),
                                             (_replace_weight, "0.weight")])
@pytest.mark.parametrize("sync", ["backward", "local_sgd"])
def test_parameters_added_after_parallelize_are_refused_on_every_rank(ranks, change, refused, sync):
    strategy = autodist.LocalSGD(every=2) if sync == "local_sgd" else sync
    for message in ranks(2, _train_after, change, strategy):
        assert message is not None and refused in message and "parallelize never saw" in message


@pytest.mark.parametrize("change", [_build_another_model, _buffer_made_in_forward])
def test_registrations_that_add_no_parameter_to_the_model_change_nothing(ranks, change):
    assert ranks(2, _train_after, change, "backward") == [None, None]


def _double_after_parallelize():
    x, y = w.digits_like(22)
    ref = w.train(w.seeded(w.mlp, 0).double(), w.loader(x.double(), y, 8), "adam", 2)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x.double(), y, 8))
    model.double()  # after parallelize: the float32 buckets must not round its float64 gradients
    return w.state(ref), w.state(w.train(model, data, "adam", 2))


def test_a_model_converted_to_float64_after_parallelize_syncs_float64_gradients(ranks):
    for ref, par in ranks(2, _double_after_parallelize):
        torch.testing.assert_close(par, ref, rtol=1e-12, atol=1e-14)
