"""The benchmarks' shared workload: the MLP 3072-2048-2048-10 of the issues' goals, and a fixed random batch."""
from __future__ import annotations

import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 3072, 2048, 10


def build_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def random_batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (size,), generator=g)
