"""DDP habits on the model parallelize returns: require_backward_grad_sync, which DDP's no_sync sets and
frameworks set around accumulation steps, accumulates locally as autodist.no_sync does (model.module is
tested with the copies, tests/train/test_copies.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autodist
import workloads as w
from autodist.runtime.position import record


def _accumulated(model, batches, flag: bool) -> dict:
    """Steps of two micro-batches each; with ``flag`` the first backward runs with require_backward_grad_sync
    False, as DDP code does around every micro-batch but the last."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = list(batches)
    for step in range(0, len(batches), 2):
        opt.zero_grad()
        for i, (x, y) in enumerate(batches[step:step + 2]):
            if flag:
                model.require_backward_grad_sync = i == 1
            (F.cross_entropy(model(x), y) / 2).backward()
        opt.step()
    return w.state(model)


@w.float64
def _require_backward_grad_sync():
    x, y = w.digits_like(24)
    reference = _accumulated(w.seeded(w.mlp, 0), w.loader(x, y, 4, shuffle=False), flag=False)
    model, loader = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 4, shuffle=False))
    before, default = record.syncs, model.require_backward_grad_sync
    trained = _accumulated(model, loader, flag=True)
    return reference, trained, record.syncs - before, default, model.require_backward_grad_sync


def test_require_backward_grad_sync_false_accumulates_locally_as_in_ddp(ranks):
    """6 global micro-batches of 4 (2 a rank), 3 steps: one gradient sync a step, not two, and the training
    of one process accumulating the same micro-batches."""
    for reference, trained, syncs, default, after in ranks(2, _require_backward_grad_sync):
        torch.testing.assert_close(trained, reference, rtol=1e-10, atol=1e-12)
        assert syncs == 3 and default is True and after is True
