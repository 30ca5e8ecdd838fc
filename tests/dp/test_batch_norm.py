"""BatchNorm in training mode normalizes by the global batch's statistics: the training of one process.

float64, every parameter and buffer (running mean, variance, batches tracked) compared with one process on the
same global batches at 1e-10: an MLP with BatchNorm1d and a small convolutional net with BatchNorm2d, shuffled
batches of 8 over 69 samples (an uneven last batch), 2 and 3 ranks; gradient accumulation (each micro-batch
normalized by its own global statistics, as one process accumulating); a rank with no row of the last batch
(6 ranks); a rank whose rows hold no valid label under a token mean; ``checkpoint=True``, which runs each block's
forward again in backward. ``batch_norm="local"`` is
DDP's per-rank statistics, which the tests tell apart.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from alike import train_in_windows
from workloads import float64, seeded

SAMPLES = 69


class BatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before a BatchNorm (its mean takes it away): its gradient would be rounding noise alone, which
        # Adam (dividing by that noise's own size) turns into steps of ~1e-11 that differ between any two splits
        self.layers = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(),
                                    nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16, momentum=None), nn.Tanh(),
                                    nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class ResNetLike(nn.Module):
    """A stem, two residual blocks with BatchNorm2d, a pooled head: ResNet's shape, small."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _data(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SAMPLES, 6, generator=g) * 2 + 1 if kind == "mlp" else torch.randn(SAMPLES, 1, 5, 5, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=g))


MODELS = {"mlp": BatchNormMLP, "conv": ResNetLike}


def _loader(kind: str) -> DataLoader:
    return DataLoader(_data(kind), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


def _cross_entropy(model: nn.Module, batch: tuple, window: int) -> None:
    (F.cross_entropy(model(batch[0]), batch[1]) / window).backward()


def _train(model: nn.Module, loader, accumulate: int = 1) -> dict[str, torch.Tensor]:
    train_in_windows(model, loader, _cross_entropy, accumulate=accumulate)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _masked_loader() -> DataLoader:
    """24 samples, unshuffled batches of 8, labels at -100 (a mean over the valid ones): the second batch's first
    half and its even rows masked, so that one rank's rows hold no valid label however the loader splits it."""
    x, y = _data("mlp").tensors
    y = y[:24].clone()
    y[[1, 8, 9, 10, 11, 12, 14, 18]] = -100
    return DataLoader(TensorDataset(x[:24], y), batch_size=8)


def _difference_here(kind: str, accumulate: int = 1, options: dict | None = None) -> float:
    """The largest difference of a parameter or buffer from one process's, in the default dtype."""
    loader = _masked_loader if kind == "masked" else lambda: _loader(kind)
    build = BatchNormMLP if kind == "masked" else MODELS[kind]
    reference = _train(seeded(build, 0), loader(), accumulate)
    model, loader = autodist.parallelize(seeded(build, 0), loader(), **(options or {}))
    trained = _train(model, loader, accumulate)
    assert trained.keys() == reference.keys()
    return max(float((trained[k].double() - reference[k].double()).abs().max()) for k in reference)


@float64
def _difference(kind: str, accumulate: int = 1, options: dict | None = None) -> float:
    """The same in float64, where any difference from one process beyond 1e-10 is a real one."""
    return _difference_here(kind, accumulate, options)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_batch_norm_trains_on_the_global_batch(ranks, kind):
    for difference in ranks(2, _difference, kind):
        assert difference <= 1e-10, f"{kind}: {difference:.3g} from one process"


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_batch_norm_at_three_ranks(ranks, kind):
    for difference in ranks(3, _difference, kind):
        assert difference <= 1e-10, f"{kind}: {difference:.3g} from one process"


def test_batch_norm_under_a_token_mean_with_a_rank_whose_labels_are_all_masked(ranks):
    """A rank whose own loss counts nothing (its share of the global loss is 0) still passes its rows the
    gradient they take through the batch's statistics from the other ranks' rows, as one process's rows."""
    for difference in ranks(2, _difference, "masked"):
        assert difference <= 1e-10, f"{difference:.3g} from one process"


def test_batch_norm_over_accumulated_micro_batches(ranks):
    for difference in ranks(2, _difference, "mlp", 3):
        assert difference <= 1e-10, f"{difference:.3g} from one process"


@pytest.mark.slow
def test_batch_norm_with_a_stand_in_row(ranks):
    """6 ranks: the last global batch of 5 leaves rank 5 a stand-in row, which no statistic counts."""
    for difference in ranks(6, _difference, "mlp"):
        assert difference <= 1e-10, f"{difference:.3g} from one process"


def test_batch_norm_recomputed_in_backward(ranks):
    """checkpoint=True: the blocks' forwards run again in backward; the statistics again, the running ones once."""
    for difference in ranks(2, _difference, "conv", 1, {"checkpoint": True}):
        assert difference <= 1e-10, f"{difference:.3g} from one process"


def test_batch_norm_in_float32(ranks):
    """float32: one process's statistics and the ranks' combined differ in their sums' order alone."""
    for difference in ranks(2, _difference_here, "conv"):
        assert difference <= 1e-4, f"{difference:.3g} from one process"


def test_local_statistics_are_ddps(ranks):
    for difference in ranks(2, _difference, "mlp", 1, {"batch_norm": "local"}):
        assert difference > 1e-3, "per-rank statistics should train differently: the test could not tell"


def _copied() -> tuple[bool, bool]:
    model, _ = autodist.parallelize(seeded(BatchNormMLP, 0))
    twin = copy.deepcopy(model)
    bn = twin.layers[1]
    return "forward" in bn.__dict__, "forward" in model.layers[1].__dict__


def test_a_copy_has_torchs_batch_norm(ranks):
    for in_copy, in_model in ranks(2, _copied):
        assert in_model and not in_copy
