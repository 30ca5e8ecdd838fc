"""Reductions along the sequence under ``cp=2``: of an input of the batch (``attention_mask.sum(-1)``, the rows'
lengths) computed on the whole batch's, as one process computes it (a model scaling its embeddings by its rows'
lengths trains as one process, float64 within 1e-10; dropping the routing of it fails); of an activation
(pooling over tokens: ``h.mean(1)``, ``h.amax(dim=1)``) refused, naming the line, where before each rank pooled
its own tokens silently. A reduction of every element (a rank's loss term) is not one. Other ops mixing an
activation's tokens are refused alike, compiled or not: a convolution over time (Mamba's causal conv), a running
sum, a roll; a convolution of kernel 1 (per token) trains as one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import ATOL, STEPS, _against_one_process
from torch import nn


class _ByLength(nn.Module):
    """Causal attention over embeddings scaled by each row's real length (the mask's sum along the tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(32, 8), nn.Linear(8, 24), nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        lengths = attention_mask.sum(-1)                   # (batch,): each row's real tokens
        x = self.embed(input_ids) * (lengths[:, None, None] / 13.0)
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 8)
        return self.head(x + y)


class _Pooled(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed, self.qkv, self.head, self.how = nn.Embedding(32, 8), nn.Linear(8, 24), nn.Linear(8, 32), how

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 8)
        pooled = y.mean(1) if self.how == "mean" else y.amax(dim=(1,))
        return self.head(pooled)[:, None, :].expand(b, t, 32)


def _samples(length: int, rows: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(length)
    samples = []
    for _ in range(rows * STEPS):
        real = int(torch.randint(1, length + 1, (), generator=g))
        mask = torch.arange(length) < real
        samples.append({"input_ids": torch.randint(0, 32, (length,), generator=g), "attention_mask": mask.long(),
                        "labels": torch.where(mask, torch.randint(0, 32, (length,), generator=g), -100)})
    return samples


def _train(model: nn.Module, loader) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in loader:
        opt.zero_grad()
        logits = model(batch["input_ids"], batch["attention_mask"])
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        opt.step()


def _by_length() -> float:
    torch.manual_seed(0)
    return _against_one_process(_ByLength().double(), _samples(13, 3), 3, _train, cp=2)


def test_a_reduction_of_an_input_along_the_sequence_is_the_whole_batchs(ranks):
    assert max(ranks(2, _by_length)) <= ATOL


def _pooled(how: str) -> str:
    torch.manual_seed(0)
    try:
        _against_one_process(_Pooled(how).double(), _samples(13, 3), 3, _train, cp=2)
    except NotImplementedError as error:
        return str(error)
    return "nothing raised"


@pytest.mark.parametrize("how", ["mean", pytest.param("amax", marks=pytest.mark.slow)])
def test_pooling_an_activation_over_the_tokens_is_refused(ranks, how):
    for said in ranks(2, _pooled, how):
        assert "reduces an activation of shape" in said and "test_reductions.py" in said, said


class _Mixed(nn.Module):
    """Attention, then an op over the tokens of its output (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed, self.qkv, self.head, self.how = nn.Embedding(32, 8), nn.Linear(8, 24), nn.Linear(8, 32), how
        self.conv = nn.Conv1d(8, 8, 1 if how == "pointwise conv" else 3, groups=8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 8)
        if self.how == "running sum":
            y = y.cumsum(1)
        elif self.how == "roll":
            y = torch.roll(y, 1, dims=1)
        else:  # Mamba's causal convolution over time: (batch, channels, tokens), padded, cut to the tokens
            pad = self.conv.kernel_size[0] - 1
            y = F.pad(y.transpose(1, 2), (pad, 0))
            y = self.conv(y)[..., :t].transpose(1, 2)
        return self.head(x + y)


def _mixed(how: str, compiled: bool) -> str | float:
    import torch._dynamo

    torch.manual_seed(0)
    train = (lambda model, loader: _train(torch.compile(model, backend="aot_eager"), loader)) if compiled else _train
    try:
        return _against_one_process(_Mixed(how).double(), _samples(13, 3), 3, train, cp=2)
    except NotImplementedError as error:
        return str(error)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("how, compiled", [("causal conv", False),
                                           pytest.param("running sum", False, marks=pytest.mark.slow),
                                           pytest.param("roll", False, marks=pytest.mark.slow),
                                           pytest.param("causal conv", True, marks=pytest.mark.slow)])
def test_an_op_mixing_an_activations_tokens_is_refused(ranks, how, compiled):
    for said in ranks(2, _mixed, how, compiled):
        assert "on an activation of shape" in said and "test_reductions.py" in said, said


@pytest.mark.slow
def test_a_pointwise_convolution_trains_as_one_process(ranks):
    assert max(ranks(2, _mixed, "pointwise conv", False)) <= ATOL
