"""The iteration of an abandoned step (elastic mode): its optimizer step and LR scheduler step do nothing, and
both count again from the next applied sync. One process: this is what the loop's own calls do."""
import torch

from autodist.dp import abandoned


def _setup():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, opt, sched


def _iteration(model, opt, sched):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()


def test_an_abandoned_iteration_moves_neither_the_weights_nor_the_schedule():
    model, opt, sched = _setup()
    _iteration(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    lr, last = opt.param_groups[0]["lr"], sched.last_epoch
    steps = [opt.state[p]["step"].clone() for p in model.parameters()]
    try:
        abandoned.mark()
        _iteration(model, opt, sched)  # the gradients are there: the step is skipped all the same
        for p, b in zip(model.parameters(), before):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
        assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == last
        assert [opt.state[p]["step"] for p in model.parameters()] == steps
        assert all(p.grad is None for p in model.parameters())
    finally:
        abandoned.committed()
    _iteration(model, opt, sched)
    assert sched.last_epoch == last + 1 and opt.param_groups[0]["lr"] == 0.1 / (last + 2)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_schedulers_with_their_own_step_are_held_too():
    _, opt, _ = _setup()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    warm = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3)
    try:
        abandoned.mark()
        opt.step()
        lr, bad, last = opt.param_groups[0]["lr"], plateau.num_bad_epochs, warm.last_epoch
        plateau.step(10.0)
        warm.step()
        assert (opt.param_groups[0]["lr"], plateau.num_bad_epochs, warm.last_epoch) == (lr, bad, last)
    finally:
        abandoned.committed()


def test_an_abandoned_forward_leaves_batchnorm_as_the_last_sync_left_it():
    from autodist.dp.buffer_sync import BufferSync

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    buffers = BufferSync(model, enabled=True)
    buffers.keep_counts()
    before = {n: b.clone() for n, b in model.named_buffers()}
    model(torch.randn(8, 3))  # training mode: running statistics and num_batches_tracked move
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    buffers.restore()
    for name, value in model.named_buffers():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
