"""What a rank joining an elastic job is sent, found in one process (autodist/dp/joining.py): the optimizer the
loop steps, not an old one over the same parameters not freed yet; a scheduler count that differs raises."""
from __future__ import annotations

import gc

import pytest
import torch

from autodist.dp import abandoned, joining


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()


def test_the_optimizer_the_loop_steps_is_sent_not_an_old_one_alive_beside_it():
    abandoned.install()
    model = _model()
    old = torch.optim.SGD(model.parameters(), lr=0.5)  # replaced, still referenced (a scheduler, a list)
    _step(model, old)
    live = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, live)
    found = joining._optimizers(model)
    assert [o for o, _ in found.values()] == [live]  # before: whichever gc listed last
    del old, live
    gc.collect()


def test_two_optimizers_over_the_same_parameters_that_never_stepped_are_refused():
    abandoned.install()
    model = _model()
    first, second = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.Adam(model.parameters())
    with pytest.raises(RuntimeError, match="2 optimizers over the same parameters of the model are alive"):
        joining._optimizers(model)
    del first, second
    gc.collect()


def test_a_joining_rank_with_another_number_of_schedulers_is_refused():
    abandoned.install()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sent = [torch.optim.lr_scheduler.StepLR(optimizer, 1).state_dict(),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5).state_dict()]
    gc.collect()  # the schedulers above are gone: this rank has none over the optimizer
    key = ",".join(str(i) for i in range(len(list(model.parameters()))))
    joining._pending = {"optimizers": {key: optimizer.state_dict()}, "schedulers": {key: sent}}
    with pytest.raises(RuntimeError, match="has 0 LR scheduler"):  # before: zip() loaded none, silently
        joining.settle(model)
    assert joining._pending is None
