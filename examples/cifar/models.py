"""The example's two models, sized from the data: TorchAD-NN's MLP and a small ConvNet."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TorchADMLP(nn.Module):
    """TorchAD-NN's README network: reshape the image to a vector, Linear, Tanh, Linear.

    On CIFAR-10 that is reshape to 3072 (TorchAD-NN's 1024 was one channel), Linear 3072->2048,
    Tanh, Linear 2048->10. With mp the two Linears form one column/row pair.
    """

    def __init__(self, image_shape: tuple[int, ...], classes: int, hidden: int = 2048) -> None:
        super().__init__()
        self.features = math.prod(image_shape)
        self.fc1 = nn.Linear(self.features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.view(-1, self.features))))


class ConvNet(nn.Module):
    """Two 3x3 conv blocks, then a Linear/Tanh/Linear head (the part model parallelism splits)."""

    def __init__(self, image_shape: tuple[int, ...], classes: int, width: int = 32, hidden: int = 256) -> None:
        super().__init__()
        channels, height, _ = image_shape
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        pooled = height // 4 if height >= 16 else height // 2
        self.pool_twice = height >= 16  # 32x32 images are pooled twice, 8x8 digits once
        self.fc1 = nn.Linear(2 * width * pooled * pooled, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        if self.pool_twice:
            x = F.max_pool2d(x, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(torch.tanh(self.fc1(torch.flatten(x, 1))))


def build(name: str, image_shape: tuple[int, ...], classes: int) -> nn.Module:
    if name == "mlp":
        return TorchADMLP(image_shape, classes)
    if name == "convnet":
        return ConvNet(image_shape, classes)
    raise ValueError(f"unknown model {name!r}: choose 'mlp' or 'convnet'")
