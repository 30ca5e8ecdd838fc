"""BatchNorm over the global batch: the statistics one process would compute, exactly, on uneven batches too.

In training mode a BatchNorm layer normalizes by its batch's mean and variance, so the batch couples its
samples: split over ranks, each rank's layer would see only its rows (DDP's behaviour, and autodist's before
this). Here every ``nn.BatchNorm*`` (and ``nn.SyncBatchNorm``) of a parallelized model computes the statistics
of the global batch:

* forward: each rank computes its rows' count, mean and sum of squared deviations per channel; the ranks
  all-gather them (as a sum of rows each rank fills alone, through shared memory on one machine:
  :mod:`autodist.layers.shared_reduce`) and combine them in rank order (Chan's parallel formula, not the sum of squares that loses
  digits), so every rank normalizes by the same mean and variance, and updates its running statistics alike.
  A rank's stand-in row (it holds no row of the batch) counts zero.
* backward: one process's gradient of a batch statistic sums ``dy`` and ``dy * x_hat`` over the whole batch.
  A model with such layers runs its backward in the global loss's units (the model's outputs' gradients are
  multiplied by the rank's share ``w_r`` of the global loss, and the sync sums the ranks' gradients:
  :mod:`autodist.runtime.units`), so ``dy`` is the global loss's: the layer all-reduces the two sums and
  returns ``dx`` as it is. A rank whose own loss counts nothing (``w_r = 0``: every label of its rows masked)
  still gets the gradient its rows take through the batch's statistics, as one process's rows do; a rank's
  stand-in row, which no statistic counted, gets none.

One all-gather of ``2C + 1`` numbers in forward and one all-reduce of ``2C`` in backward per layer, as torch's
``SyncBatchNorm`` (which needs a GPU, and weights every rank alike); between the ranks of one machine on the
CPU they go through the shared-memory all-reduce of the model-parallel layers (microseconds, where gloo's took
about a millisecond each). The layer keeps its class; its forward
is an instance attribute (``module.__dict__["forward"]``), set aside when the model is copied.

Example:
    >>> install(model, lambda: group, lambda: False,   # parallelize does this, the sync in global units
    ...         lambda t: shared_reduce.all_reduce(t, group, "sums"))
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autodist.runtime.position import waiting

Rows = Callable[[], bool]  # whether the forward running now is a stand-in's
Group = Callable[[], Any]  # the data-parallel group now (an elastic job's changes when it loses a rank)
Sum = Callable[[torch.Tensor], None]  # sums a few numbers over that group in place (the gradient sync's)


class _Global(torch.autograd.Function):
    """Batch normalization by the global batch's statistics (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                stats: tuple[torch.Tensor, torch.Tensor, float], eps: float, sum_: Sum, counts: bool) -> torch.Tensor:
        mean, var, total = stats
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        # torch's kernel with the statistics given (eval mode: nothing updated, nothing of them differentiated)
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.total, ctx.sum, ctx.counts, ctx.eps, ctx.has_bias = total, sum_, counts, eps, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, mean, var = ctx.saved_tensors
        shape = [1, -1] + [1] * (x.dim() - 2)
        gamma = weight if weight is not None else torch.ones_like(mean)
        # torch's eval-mode backward: dy * gamma * invstd, and this rank's sums of dy * x_hat and of dy, in one kernel
        # (the saved statistics empty, not None: CUDA's kernel then reads the given ones, and asserts without them)
        none = mean.new_empty(0)
        dx, s2, s1 = torch.ops.aten.native_batch_norm_backward(
            dy, x, gamma, mean, var, none, none, False, ctx.eps, [ctx.needs_input_grad[0], True, True])
        sums = torch.stack([s1, s2]).to(torch.promote_types(x.dtype, torch.float32))
        if not ctx.counts:  # a stand-in's rows: no gradient of the batch's, and nothing added to the sums
            sums.zero_()
        with waiting("BatchNorm's global statistics (backward)"):
            ctx.sum(sums)
        if ctx.needs_input_grad[0]:
            if ctx.counts:  # minus gamma invstd (A + x_hat B) / M: A and B the sums over the global batch
                invstd = torch.rsqrt(var + ctx.eps)
                scale = (gamma * invstd).to(sums.dtype) / ctx.total
                centered = (x - mean.view(shape)).mul_((sums[1] * scale * invstd).to(x.dtype).view(shape))
                dx = dx.sub_(centered).sub_((sums[0] * scale).to(x.dtype).view(shape))
            else:  # no row here counts: nothing of the batch flows through this rank's input
                dx = torch.zeros_like(dy)
        dweight = s2 if weight is not None and ctx.needs_input_grad[1] else None
        dbias = s1 if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None


def statistics(x: torch.Tensor, counts: bool, group: Any, sum_: Sum) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The global batch's per-channel mean and (biased) variance, and its values per channel; ``counts``
    False: this rank's rows count zero (a stand-in). Every rank of ``group`` must call it; ``sum_`` sums over it."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    dims = [0] + list(range(2, x.dim()))
    c = x.shape[1]
    n = x.numel() // c if counts else 0
    rank, size = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank(), group.size())
    gathered = torch.zeros(size, 1 + 2 * c, dtype=dtype, device=x.device)  # (an elastic group is not registered)
    if n:  # an all-gather as a sum of rows each rank fills alone (exact)
        rows = x.detach().to(dtype)
        mean = rows.mean(dims)  # two passes (var_mean's one is 10x slower on a CPU), no sum of squares
        mine = gathered[rank]
        mine[0], mine[1:1 + c] = n, mean
        mine[1 + c:] = (rows - mean.view([1, -1] + [1] * (x.dim() - 2))).square().sum(dims)
    with waiting("BatchNorm's global statistics (forward)"):
        sum_(gathered)
    counts_, means, m2s = gathered[:, :1], gathered[:, 1:1 + c], gathered[:, 1 + c:]
    total = float(counts_.sum())  # host sync on a GPU: the number of values normalized, for the backward
    mean = (counts_ * means).sum(0) / total
    # Chan et al.'s combination of the ranks' parts (rank order, the same on every rank): no sum of squares
    m2 = m2s.sum(0) + (counts_ * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class GlobalForward:
    """The forward of one BatchNorm layer of a parallelized model: the global batch's statistics where the
    layer uses batch statistics (training mode, or no running statistics), its own forward otherwise."""

    def __init__(self, module: nn.modules.batchnorm._BatchNorm, group: Group, sum_: Sum, stand_in: Rows) -> None:
        self.module = weakref.ref(module)
        self.group, self.sum, self.stand_in = group, sum_, stand_in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.module()
        assert bn is not None
        own = type(bn).forward
        if not (bn.training or bn.running_mean is None) or torch.compiler.is_compiling():
            return own(bn, x)
        if isinstance(bn, nn.SyncBatchNorm):
            if x.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")
        else:
            bn._check_input_dim(x)
        # the forward again in backward (checkpoint=True recomputes a block): the statistics again, not the update
        updates = bn.training and bn.track_running_stats and torch._C._current_graph_task_id() == -1
        factor = bn.momentum if bn.momentum is not None else 0.0
        if updates and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        counts = not self.stand_in()
        mean, var, total = statistics(x, counts, self.group(), self.sum)
        if bn.training and total <= 1:  # what one process raises for its batch, said of the global batch
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.size()} "
                             f"(the global batch holds {total:g} value(s) per channel)")
        if updates:
            with torch.no_grad():
                unbiased = var * (total / (total - 1)) if total > 1 else var
                bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
                bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
        return _Global.apply(x, bn.weight, bn.bias, (mean, var, total), bn.eps, self.sum, counts)


def layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers (``SyncBatchNorm`` included)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def install(model: nn.Module, group: Group, stand_in: Rows, sum_: Sum) -> int:
    """Give each BatchNorm layer of ``model`` the global batch's statistics; returns how many it has. ``group()``
    is the data-parallel group at each call, and ``sum_`` sums over it (the gradient sync's: through shared
    memory on one machine; in an elastic job, one that a lost rank fails into the abandoned step). The model's
    backward must run in the global loss's units (:meth:`autodist.dp.grad_sync.GradSync.global_units`)."""
    found = layers(model)
    for bn in found:
        bn.__dict__["forward"] = GlobalForward(bn, group, sum_, stand_in)
    return len(found)


def is_global(forward: Any) -> bool:
    """Whether a module's instance ``forward`` is this one (a copy of the model leaves it out)."""
    return isinstance(forward, GlobalForward)
