"""``autodist.whole_batch(x)``: the rows of every data-parallel rank, for a loss that compares each sample with
the whole batch (in-batch negatives: CLIP, SimCLR, sentence embeddings).

A contrastive loss scores each row against every row of the batch: split over ranks, each rank would see only
its own rows as negatives, and train something else than one process does. ``whole_batch(x)`` gives every rank
the global batch's rows of ``x`` in the batch's order (a rank's stand-in row left out), so the loss the user
writes runs on the whole batch unchanged:

* forward: the ranks all-gather their row counts and their rows;
* backward: each rank's gradient of its own loss enters the global loss's weighted by the rank's share of the
  sync (``w_r``, which the sync multiplies the rank's gradients by afterwards); the ranks all-reduce those
  weighted gradients, and each takes its own rows' part divided by its own share. Every rank may compute the
  whole batch's loss (the ranks' shares are then alike) or only its own rows' against all the others (the
  shares are its rows): either is exactly one process's gradient.

One all-gather forward and one all-reduce backward of the whole batch's rows, as ``torch.distributed.nn``'s
gather with gradient (open_clip's ``gather_with_grad``), which leaves the weighting to the loss.

Example:
    >>> image, text = model(images, texts)                          # this rank's rows
    >>> image, text = autodist.whole_batch(image), autodist.whole_batch(text)
    >>> logits = image @ text.T / temperature                       # the global batch's, on every rank
    >>> loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
"""
from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp.grad_sync import GradSync, parallelized, state_of
from autodist.runtime import provenance
from autodist.runtime.position import waiting
from autodist.runtime.world import log


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sync: GradSync, dim: int) -> torch.Tensor:
        share = provenance.current()  # the batch in hand (the forward may have called submodules alone)
        standing_in = sync.standing_in or (share is not None and share.count == 0)
        mine = x.narrow(dim, 0, 0) if standing_in else x  # a stand-in's row is no row of the batch
        group = sync.group
        sizes = torch.tensor([mine.shape[dim]], dtype=torch.int64, device=x.device)
        every = [torch.empty_like(sizes) for _ in range(dist.get_world_size(group))]
        with waiting("autodist.whole_batch: the ranks' row counts"):
            dist.all_gather(every, sizes, group=group)
        counts = [int(n) for n in every]
        padded = torch.zeros((*x.shape[:dim], max(counts), *x.shape[dim + 1:]), dtype=x.dtype, device=x.device)
        padded.narrow(dim, 0, counts[dist.get_rank(group)]).copy_(mine)
        parts = [torch.empty_like(padded) for _ in counts]
        with waiting("autodist.whole_batch: the ranks' rows"):
            dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.sync, ctx.dim, ctx.counts, ctx.rows = sync, dim, counts, x.shape[dim]
        ctx.rank = dist.get_rank(group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, counts)], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        sync, dim, counts = ctx.sync, ctx.dim, ctx.counts
        share = sync.backward_weight()
        summed = (grad * share).contiguous()
        with waiting("autodist.whole_batch: the gradients of the ranks' rows"):
            dist.all_reduce(summed, group=sync.group)
        mine = torch.zeros((*grad.shape[:dim], ctx.rows, *grad.shape[dim + 1:]), dtype=grad.dtype,
                           device=grad.device)
        if counts[ctx.rank]:
            start = sum(counts[:ctx.rank])
            if share > 0:
                mine.narrow(dim, 0, counts[ctx.rank]).copy_(summed.narrow(dim, start, counts[ctx.rank]) / share)
            elif not sync.warned_whole and bool(summed.narrow(dim, start, counts[ctx.rank]).any()):
                sync.warned_whole = True
                log.warning("autodist.whole_batch: this rank's loss counts nothing this step (every label -100?), "
                            "so the sync weights its gradients by 0, and the gradient its rows take from the other "
                            "ranks' losses is left out of this step: not one process's training. Compute the loss "
                            "over the whole batch on every rank (each rank's share is then alike)")
        return mine, None, None


def whole_batch(x: torch.Tensor, model: nn.Module | None = None, *, dim: int = 0) -> torch.Tensor:
    """The rows of ``x`` from every data-parallel rank, in the global batch's order, on every rank; its gradient
    is exactly one process's (see the module docstring).

    Args:
        x: this rank's rows (embeddings, logits) along ``dim``, computed from the batch the DataLoader
            ``parallelize`` returned handed out.
        model: the parallelized model ``x`` comes from; needed only when several are parallelized.
        dim: the dimension that holds the rows.

    Returns:
        The global batch's rows: ``x`` itself in a world of one, or for a model with no data parallelism.

    Example:
        >>> image, text = autodist.whole_batch(image), autodist.whole_batch(text)
        >>> loss = clip_loss(image @ text.T)        # the one-process loss, unchanged, on every rank

    Note:
        Every data-parallel rank must call it, in the same order (a collective). A rank's stand-in row (it holds
        no row of a short last batch) is left out.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"autodist.whole_batch takes a tensor of this rank's rows, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"autodist.whole_batch: dim must index a dimension of x (shape {tuple(x.shape)}), got "
                         f"{dim!r}")
    sync = _sync_of(model)
    if sync is None:
        return x
    return _Gather.apply(x, sync, dim % x.dim())


def _sync_of(model: nn.Module | None) -> GradSync | None:
    """The exact sync of ``model``, or of the one parallelized model; None where there is no data parallelism."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
        return state_of(model)
    syncs = [s for m in parallelized() if (s := state_of(m)) is not None]
    if len(syncs) > 1:  # a model dropped may live on in a reference cycle until the collector runs
        gc.collect()
        syncs = [s for m in parallelized() if (s := state_of(m)) is not None]
    if len(syncs) > 1:
        raise ValueError(f"autodist.whole_batch: {len(syncs)} parallelized models sync gradients here; say which one "
                         f"x comes from: autodist.whole_batch(x, model)")
    return syncs[0] if syncs else None
