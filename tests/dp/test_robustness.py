"""What users do that the happy path does not: constant buffers, unfreezing, a backward that raises."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from alike import assert_same_training


class Masked(nn.Module):
    """A Linear plus two buffers no forward writes: a -inf logit mask and a constant table."""

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(features, classes)
        self.register_buffer("mask", torch.tensor([0.0, -math.inf, 0.0]))
        self.register_buffer("table", torch.rand(1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.mask + 0.0 * self.table[:1]


def _masked_run():
    # 17 samples, batch 8, 3 ranks: the last global batch has 1 sample, so two ranks hold none.
    return w.reference_and_parallel(Masked, lambda: w.loader(*w.digits_like(17), 8), "adam", 2)


def test_buffers_no_forward_writes_stay_exact(ranks):
    results = ranks(3, _masked_run)
    assert_same_training(results)
    for ref, par in results:
        # not averaged at all: -inf stays -inf (an empty rank's weight 0 must not make it NaN),
        # and the constant table keeps every bit (rank 0's, as broadcast)
        assert_close(par["mask"], ref["mask"], rtol=0, atol=0)
        assert_close(par["table"], ref["table"], rtol=0, atol=0)


def _train_unfreezing(model: nn.Module, loader) -> nn.Module:
    model[0].requires_grad_(False)
    opt = w.optimizer("adam", model)  # holds every parameter; frozen ones have no grad and are skipped
    for epoch in range(3):
        if epoch == 1:
            model[0].requires_grad_(True)  # fine-tuning: unfreeze the first layer after one epoch
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def _unfreeze_run():
    data = w.digits_like(22)
    ref = _train_unfreezing(w.seeded(w.mlp, 0), w.loader(*data, 8))
    model = w.seeded(w.mlp, w.rank())
    model[0].requires_grad_(False)  # as on every rank when parallelize runs
    model, loader = autodist.parallelize(model, w.loader(*data, 8))
    return w.state(ref), w.state(_train_unfreezing(model, loader))


def test_unfreezing_after_parallelize(ranks):
    assert_same_training(ranks(2, _unfreeze_run))


class _Boom(RuntimeError):
    pass


def _raise_in_backward(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    out.register_hook(lambda grad: (_ for _ in ()).throw(_Boom("simulated failure in backward")))


def _raise_in_first_backward_op(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    # the model's very first backward op fails, before any parameter has a gradient
    out.grad_fn.register_prehook(lambda grads: (_ for _ in ()).throw(_Boom("simulated failure in backward")))


def _train_with_a_failing_backward(model: nn.Module, loader, where: int) -> nn.Module:
    """Batch 1's backward raises (as an out-of-memory error would); the loop skips that batch."""
    opt = w.optimizer("sgd", model)
    trap_kind = _raise_in_first_backward_op if where == len(model) - 1 else _raise_in_backward
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        trap = model[where].register_forward_hook(trap_kind) if i == 1 else None
        loss = F.cross_entropy(model(x), y)
        if trap is not None:
            trap.remove()
        try:
            loss.backward()
        except _Boom:
            opt.zero_grad()
            continue
        opt.step()
    return model


def _failing_backward_run(where: int):
    data = w.digits_like(17)
    ref = _train_with_a_failing_backward(w.seeded(w.mlp, 0), w.loader(*data, 8), where)
    # tiny buckets: the later layers' buckets are already sent when a failure halfway strikes
    model, loader = autodist.parallelize(w.seeded(w.mlp, w.rank()), w.loader(*data, 8),
                                         first_bucket_mb=0.0002, bucket_mb=0.0002)
    return w.state(ref), w.state(_train_with_a_failing_backward(model, loader, where))


@pytest.mark.parametrize("where", [1, 4])  # halfway through backward; in its first op
def test_training_goes_on_after_a_backward_raised(ranks, where):
    # 17 samples in batches of 8 on 3 ranks: shares differ between steps, so stale counts would show
    assert_same_training(ranks(3, _failing_backward_run, where))


def _frozen_on_rank_zero_only():
    model = w.seeded(w.mlp, 0)
    if w.rank() == 0:
        model[2].weight.requires_grad_(False)
    try:
        autodist.parallelize(model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_frozen_on_one_rank_only_is_named(ranks):
    for msg in ranks(2, _frozen_on_rank_zero_only, timeout=30):
        assert "'2.weight'" in msg and "requires_grad False on rank 0, True on rank 1" in msg, msg


def _average_half_precision_weights():
    model = w.seeded(w.mlp, 0).half()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(w.rank()))
    autodist.synchronize_model(model, what="parameters")  # needs no gradient machinery, so no fp16 refusal
    return [p.detach().clone() for p in model.parameters()], len(model._forward_pre_hooks)


def test_parameter_averaging_of_an_unparallelized_half_model(ranks):
    for params, hooks in ranks(2, _average_half_precision_weights):
        assert hooks == 0
        for p in params:
            assert_close(p, torch.full_like(p, 0.5), rtol=0, atol=0)


def _bn_then_average_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    model(w.digits_like(8, seed=w.rank())[0])  # train mode: each rank's running mean moves its own way
    autodist.synchronize_model(model)  # never parallelized: the first call builds the sync state
    return model[1].running_mean.clone()


def test_synchronize_model_averages_buffers_changed_before_its_first_call(ranks):
    a, b = ranks(2, _bn_then_average_buffers)
    assert_close(a, b, rtol=0, atol=0)


def _penalized_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus a gradient penalty: torch.autograd.grad runs a backward through the model first."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (grad_x,) = torch.autograd.grad(out.logsumexp(1).sum(), x, create_graph=True)
    return F.cross_entropy(out, y) + 0.1 * grad_x.pow(2).sum(1).mean()


def _gradient_penalty_run():
    data = w.digits_like(22)
    ref, model = w.seeded(w.mlp, 0), w.seeded(w.mlp, w.rank())
    model, loader = autodist.parallelize(model, w.loader(*data, 8))
    for m, batches in ((ref, w.loader(*data, 8)), (model, loader)):
        opt = w.optimizer("adam", m)
        for _ in range(2):
            for x, y in batches:
                opt.zero_grad()
                _penalized_loss(m, x, y).backward()
                opt.step()
    return w.state(ref), w.state(model)


def test_gradient_penalty_inside_the_loss(ranks):
    # the inner backward brings no parameter gradient: it must neither sync nor reset the step's counts
    assert_same_training(ranks(3, _gradient_penalty_run))


class Tracking(nn.Module):
    """BatchNorm (float32, rides in the last gradient bucket) and a float64 running sum of the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("seen", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen.mul_(0.5).add_(x.double().mean(0))
        return self.bn(self.lin(x))


def _tracking_steps():
    torch.manual_seed(0)
    model, _ = autodist.parallelize(Tracking())
    x = w.digits_like(8, seed=w.rank())[0][:, :6]
    taken = []
    for step in range(3):
        if step == 2:  # a buffer replaced by one of another shape after the buckets were built
            model.bn.running_mean = torch.zeros(3)
            model.register_buffer("seen", torch.zeros(7, dtype=torch.float64))
            x7 = torch.cat([x, x[:, :1]], 1)
            model.forward = lambda inp, m=model: m.bn(m.lin(inp[:, :6])) + 0 * m.seen.add_(inp.double().mean(0)).sum()
            F.cross_entropy(model(x7), torch.zeros(8, dtype=torch.long)).backward()
        else:
            F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        taken.append({k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()})
    return x, taken


def test_buffers_of_every_dtype_and_replaced_buffers_are_averaged(ranks):
    (x0, steps0), (x1, steps1) = ranks(2, _tracking_steps)
    for a, b in zip(steps0, steps1):
        for name in a:  # the ranks saw different inputs, yet agree on every buffer after every step
            assert_close(a[name], b[name], rtol=0, atol=0, msg=f"ranks disagree on {name}")
    # the float64 buffer is the average of the ranks' own running sums (equal weights: 8 samples each)
    expected = torch.zeros(6, dtype=torch.float64)
    for _ in range(2):
        expected = 0.5 * expected + (x0.double().mean(0) + x1.double().mean(0)) / 2
    assert_close(steps0[1]["seen"], expected)
    assert steps0[2]["seen"].shape == (7,) and steps0[2]["bn.running_mean"].abs().sum() > 0
