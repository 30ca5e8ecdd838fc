"""``autodist.explain(model, cp=K, example=...)``: the cut of the sequence, the attention work per rank, and the
bytes each rank exchanges for each attention call, read from one forward in one process; the bytes checked
against what a context-parallel training step puts into its collectives (counted on 2 real ranks), on nanoGPT,
on Hugging Face's Llama with grouped-query attention, and on torch's nn.TransformerEncoder."""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import _data, _gpt, _hugging_face
from test_multihead import _Encoder
from torch import nn
from torch.utils.data import DataLoader

import autodist
from autodist.layers import context


def _model(name: str, length: int) -> nn.Module:
    return {"gpt": lambda: _gpt(length), "llama": lambda: _hugging_face("llama"),
            "encoder": lambda: _Encoder().double()}[name]()


def _loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return model(x, y)[1]
    if name == "encoder":
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-1)
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten(), ignore_index=-1)


def test_the_plan_shows_the_cut_each_call_and_its_bytes():
    idx = torch.randint(0, 32, (2, 61))
    plan = autodist.explain(_gpt(61), cp=2, example=(idx,))
    assert [call.line.split(":")[0] for call in plan.calls] == ["nanogpt.py"] * 2  # one per block
    assert plan.split.sizes == [31, 30] and plan.work_balance() <= 1.05, (plan.split.sizes, plan.work_balance())
    call = plan.calls[0]
    assert (call.query, call.heads, call.key_width, call.value_width, call.element) == ((2, 2, 61, 8), 2, 8, 8, 8)
    assert call.causal and call.again  # causal, no mask, on CPU: the keys are gathered again in backward
    # forward: its 31 tokens (the widest) of 2 rows x 2 heads x (8 + 8) float64 to the other rank
    assert call.sent(plan.split) == (2 * 2 * 31 * 16 * 8, 2 * 2 * 31 * 16 * 8 + 2 * 2 * 61 * 16 * 8)
    text = str(plan)
    assert "rank 0: 0-15, 46-60 (31 tokens); rank 1: 16-30, 31-45 (30 tokens)" in text, text
    assert "nanogpt.py:" in text and " x 2 |" in text, text
    balance = [autodist.explain(_gpt(n), cp=k, example=(torch.randint(0, 32, (1, n)),)).work_balance()
               for n, k in [(64, 2), (97, 3), (128, 4), (1021, 4)]]
    assert max(balance) <= 1.05, balance


def test_a_model_without_sdpa_is_named_and_the_wrong_calls_are_refused():
    plan = autodist.explain(nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32)), cp=2,
                            example=torch.randint(0, 32, (2, 9)))
    assert plan.calls == [] and plan.length == 9 and "refuses this model" in str(plan), str(plan)
    with pytest.raises(ValueError, match="example="):
        autodist.explain(_gpt(16), cp=2)
    with pytest.raises(ValueError, match="cp must be a positive int"):
        autodist.explain(_gpt(16), cp=0, example=(torch.randint(0, 32, (1, 16)),))


@contextlib.contextmanager
def counting() -> Iterator[tuple[list[int], list[int]]]:
    """The bytes each context-parallel all-gather and all-reduce takes from this rank while open (lists filled as
    they run): what :mod:`autodist.layers.context` puts into its collectives."""
    gathered, reduced, real = [], [], context.dist

    def gather(parts: list, t: torch.Tensor, *args, **kwargs):
        gathered.append(t.numel() * t.element_size())
        return real.all_gather(parts, t, *args, **kwargs)

    def reduce(t: torch.Tensor, *args, **kwargs):
        reduced.append(t.numel() * t.element_size())
        return real.all_reduce(t, *args, **kwargs)
    context.dist = types.SimpleNamespace(all_gather=gather, all_reduce=reduce)
    try:
        yield gathered, reduced
    finally:
        context.dist = real


def _counted_step(name: str, length: int, rows: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """One cp=2 training step, the bytes this rank put into the attention's all-gathers and all-reduces, beside
    what explain counts for the same global batch."""
    data = _data(length, rows, "all")
    x, y = data.tensors[0][:rows], data.tensors[1][:rows]
    plan = autodist.explain(_model(name, length), cp=2, example={"input_ids": x} if name == "llama" else (x,))
    model, loader = autodist.parallelize(_model(name, length), DataLoader(data, batch_size=rows), cp=2)
    with counting() as (gathered, reduced):
        batch = next(iter(loader))
        _loss(name, model, *batch).backward()
    split = plan.split
    expected_gathers = [c.contribution(split) for c in plan.calls] + \
        [c.contribution(split) for c in reversed(plan.calls) if c.again]
    return gathered, expected_gathers, reduced, [c.whole(split) for c in reversed(plan.calls)]


@pytest.mark.parametrize("name, length, rows", [("gpt", 13, 3), pytest.param("llama", 11, 2, marks=pytest.mark.slow),
                                                pytest.param("encoder", 13, 2, marks=pytest.mark.slow)])
def test_the_bytes_explain_counts_are_the_bytes_put_into_the_collectives(ranks, name, length, rows):
    for gathered, expected_gathers, reduced, expected_reduced in ranks(2, _counted_step, name, length, rows):
        assert sorted(gathered) == sorted(expected_gathers) and len(gathered) == len(expected_gathers), \
            (gathered, expected_gathers)
        assert reduced == expected_reduced, (reduced, expected_reduced)
