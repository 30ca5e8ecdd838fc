"""``loss_fn=`` without ``pp``: ``model(x, target=y)`` returns ``loss_fn(model(x), y)``, as in one process and
under ``pp`` (1F1B), so one loop runs every layout ``plan=`` may choose; a token mean with labels masked unequally
over the ranks and a short last batch trains as one process (float64, 2 ranks), with ``shard=`` and ``mp``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def _loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, ignore_index=-100)


def _loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(22, 6, generator=g), torch.randint(0, 5, (22,), generator=g)
    y[::3] = -100  # unequal valid counts over the ranks' rows: the mean is the batch's tokens', not the rows'
    return w.loader(x, y, 8, shuffle=False)  # 8, 8, 6 rows


def _train(model: nn.Module, batches, inside: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        (model(x, target=y) if inside else _loss_fn(model(x), y)).backward()
        opt.step()
    return dict(autodist.gather_state_dict(model, all_ranks=True)) if autodist.world_size() > 1 else w.state(model)


@w.float64
def _both(options: dict):
    reference = _train(w.seeded(_build, 0), _loader(), False)
    model, loader = autodist.parallelize(w.seeded(_build, 0), _loader(), loss_fn=_loss_fn, **options)
    return reference, _train(model, loader, True)


@pytest.mark.parametrize("options", [pytest.param({}, id="dp"),
                                     pytest.param({"shard": "parameters"}, id="parameters", marks=pytest.mark.slow),
                                     pytest.param({"mp": 2}, id="mp2", marks=pytest.mark.slow)])
def test_the_loss_inside_the_forward_trains_as_one_process(ranks, options):
    for reference, trained in ranks(2, _both, options):
        assert_close(trained, reference, rtol=0, atol=1e-12)


def test_cp_with_the_loss_inside_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="loss_fn= \\(the loss inside the model's forward"):
        autodist.parallelize(_build(), _loader(), cp=2, loss_fn=_loss_fn)
