"""torch's own attention layers under ``cp=K``: ``nn.TransformerEncoder`` (its layers' ``nn.MultiheadAttention``)
with the causal mask built from the rank's tokens by ``nn.Transformer.generate_square_subsequent_mask`` and a
``src_key_padding_mask`` from the batch, and a bare ``nn.MultiheadAttention`` asked for its weights (the
default), trained 20 AdamW steps in float64 within 1e-10 of one process; what it cannot split is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import ATOL, STEPS, _against_one_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class _Encoder(nn.Module):
    """A causal language model of torch's layers: embedding, nn.TransformerEncoder, a head."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.causal = causal
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=x.dtype) if self.causal else None
        pad = None if padding is None else padding == 0
        return self.head(self.encoder(x, mask=mask, src_key_padding_mask=pad, is_causal=self.causal))


class _Weights(nn.Module):
    """A bare nn.MultiheadAttention over the whole sequence (no mask), its weights asked for (the default)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.attn, self.head = nn.Embedding(32, 16), nn.MultiheadAttention(16, 2), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).transpose(0, 1)  # (tokens, batch, embed): the layer's default layout
        out, weights = self.attn(x, x, x)
        assert weights.shape == (ids.shape[0], ids.shape[1], weights.shape[-1])  # this rank's rows, every key
        return self.head(out.transpose(0, 1))


def _data(length: int, rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 32, (rows * STEPS, length), generator=g)
    real = torch.randint(2, length + 1, (rows * STEPS, 1), generator=g)
    padding = (torch.arange(length)[None] < real).long()  # right padding, at least two tokens a row
    labels = torch.randint(0, 32, (rows * STEPS, length), generator=g).masked_fill(padding == 0, -100)
    return TensorDataset(ids, padding, labels)


def _train(model: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for ids, padding, labels in loader:
        opt.zero_grad()
        F.cross_entropy(model(ids, padding).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        opt.step()


def _largest_difference(kind: str, cp: int, length: int, rows: int) -> float:
    model = {"encoder": lambda: _Encoder(), "bidirectional encoder": lambda: _Encoder(causal=False),
             "weights": _Weights}[kind]()
    return _against_one_process(model.double(), _data(length, rows), rows, _train, cp=cp)


@pytest.mark.parametrize("kind, cp, world, length, rows", [
    ("encoder", 2, 2, 13, 3),
    pytest.param("weights", 2, 2, 11, 2, marks=pytest.mark.slow),
    pytest.param("bidirectional encoder", 3, 3, 17, 2, marks=pytest.mark.slow),
])
def test_torchs_attention_layers_train_as_one_process(ranks, kind, cp, world, length, rows):
    differences = ranks(world, _largest_difference, kind, cp, length, rows)
    assert max(differences) <= ATOL, differences
