"""Training a reference model and its parallel twin the same way, for the exactness tests."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.testing import assert_close


def train_alike(models: tuple[nn.Module, ...], loss_of: Callable[[nn.Module], torch.Tensor],
                steps: int = 3) -> list[torch.optim.Optimizer]:
    """``steps`` Adam steps (lr 1e-3) on each model, each from the same RNG state (seed 11), so that the
    single-process model and the parallel one draw the same dropout masks; returns their optimizers.

    Example:
        >>> train_alike((ref, model), lambda m: m(**batch).loss)
    """
    optimizers = []
    for m in models:
        torch.manual_seed(11)
        optimizer = torch.optim.Adam(m.parameters(), lr=1e-3)
        for _ in range(steps):
            optimizer.zero_grad()
            loss_of(m).backward()
            optimizer.step()
        optimizers.append(optimizer)
    return optimizers


def assert_same_training(results: list[tuple[dict, dict]], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Each rank's parameters equal the single-process run's (``results``: per rank, (reference, parallel)),
    and every rank holds the very same model."""
    for ref, par in results:
        assert_close(par, ref, rtol=rtol, atol=atol)
    for _, par in results[1:]:
        assert_close(par, results[0][1], rtol=0, atol=0)  # every rank holds the very same model


def train_in_windows(model: nn.Module, loader, backward: Callable[[nn.Module, tuple, int], None], epochs: int = 2,
                     accumulate: int = 1, lr: float = 1e-2) -> None:
    """Adam (``lr``) over each epoch's batches in windows of ``accumulate``: ``backward(model, batch, len(window))``
    for each batch, all but a window's last inside ``autodist.no_sync``; a model with ``sync="manual"`` is
    synchronized before each step. The same loop trains the single-process reference (no_sync does nothing).

    Example:
        >>> def backward(m, batch, window):
        ...     (F.cross_entropy(m(batch[0]), batch[1]) / window).backward()
        >>> train_in_windows(model, loader, backward, accumulate=3)
    """
    import autodist
    from autodist.dp.grad_sync import state_of

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        batches = list(loader)
        for start in range(0, len(batches), accumulate):
            window = batches[start:start + accumulate]
            optimizer.zero_grad()
            for k, batch in enumerate(window):
                if k < len(window) - 1:
                    with autodist.no_sync(model):
                        backward(model, batch, len(window))
                else:
                    backward(model, batch, len(window))
            sync = state_of(model)
            if sync is not None and not sync.hooks:  # sync="manual"
                autodist.synchronize_model(model)
            optimizer.step()
