"""Attention written out by hand under ``cp=K``: Hugging Face's ``eager`` attention (``softmax(q @ k^T * scale + mask)
@ v``, its mask built over the rank's tokens), its scores taken over the whole sequence's keys; Llama and Qwen2,
unpadded and with padding, and nanoGPT's own (``masked_fill`` of its causal buffer), trained 20 AdamW steps in
float64 within 1e-10 of one process (with its own eager attention). What else a model does to its scores is refused,
naming it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import ATOL, _against_one_process, _data, _gpt, _hugging_face, _train, _train_outside
from test_masks import _padded, _train_hf
from torch import nn


def _largest_difference(family: str, cp: int, length: int, rows: int, padded: bool) -> float:
    model = _hugging_face(family, "eager")
    if padded:
        # padding in the middle of the rows: at the start, a query with no token to attend to is NaN in one
        # process's eager attention in float64 (its lowest float64 turns -inf in its float32 softmax)
        return _against_one_process(model, _padded(length, rows, "middle"), rows, _train_hf, cp=cp)
    return _against_one_process(model, _data(length, rows, "prompt"), rows, _train_outside, cp=cp)


@pytest.mark.parametrize("family, cp, world, length, rows, padded", [
    pytest.param("llama", 2, 2, 13, 3, False, marks=pytest.mark.slow),
    ("llama", 2, 2, 13, 3, True),
    pytest.param("qwen2", 3, 3, 17, 2, True, marks=pytest.mark.slow),
])
def test_hugging_faces_eager_attention_trains_as_one_process(ranks, family, cp, world, length, rows, padded):
    differences = ranks(world, _largest_difference, family, cp, length, rows, padded)
    assert max(differences) <= ATOL, differences


def _largest_difference_gpt(length: int, rows: int) -> float:
    model = _gpt(length)
    for block in model.transformer.h:  # nanoGPT's own attention by hand (its path without flash attention)
        size = model.config.block_size
        block.attn.flash = False
        block.attn.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
    return _against_one_process(model, _data(length, rows, "prompt"), rows, _train, cp=2)


@pytest.mark.slow
def test_nanogpts_attention_by_hand_trains_as_one_process(ranks):
    """``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))``: the causal block of the rank's tokens,
    read as causal; its fill over the whole rows instead."""
    differences = ranks(2, _largest_difference_gpt, 13, 3)
    assert max(differences) <= ATOL, differences


class _ScoresPooled(nn.Module):
    """Attention by hand whose scores are summed over the keys, or softmaxed over the queries: refused."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        scores = x @ x.transpose(-2, -1)
        if self.how == "sum":
            return self.head(x * scores.sum(-1, keepdim=True))
        return self.head(F.softmax(scores, dim=-2) @ x)


def _refused(how: str) -> str:
    import autodist

    data = _data(13, 3, "all")
    model, loader = autodist.parallelize(_ScoresPooled(how), torch.utils.data.DataLoader(data, batch_size=3), cp=2)
    x, _ = next(iter(loader))
    try:
        model(x)
    except NotImplementedError as error:
        return str(error)
    return "nothing raised"


@pytest.mark.parametrize("how, says", [("sum", "calls sum on its scores"),
                                       ("softmax", "softmax of its scores over dimension -2")])
def test_other_uses_of_the_scores_are_refused(ranks, how, says):
    for message in ranks(2, _refused, how):
        assert says in message, message
