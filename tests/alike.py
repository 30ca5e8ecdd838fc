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
