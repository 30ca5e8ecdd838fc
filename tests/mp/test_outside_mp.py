"""Model parallelism on model code from outside this project: nanoGPT's GPT (tests/outside/nanogpt.py).

torch.fx cannot trace GPT (``assert t <= block_size`` on a traced value), so the plan is read from one
recorded forward on two samples of the data: each block's MLP (c_fc -> GELU -> c_proj) is a Megatron pair,
so is its attention (the fused c_attn split in three blocks so each rank holds its heads of q, k and v, the
head views, transposes and scaled_dot_product_attention run on those heads, c_proj split by rows), and
lm_head, tied to the token embedding, stays whole.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

import autodist
from alike import train_alike
from collectives import counted
from outside.nanogpt import GPT, GPTConfig

CONFIG = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=True)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=g)
    return x, torch.roll(x, -1, 1)


def _gpt(seed: int, dropout: float = 0.0) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(CONFIG, dropout=dropout)).double()


def test_nanogpt_plan_splits_every_attention_and_mlp_and_keeps_the_tied_head():
    x, _ = _tokens()
    plan = autodist.explain(_gpt(0), mp=2, example=(x[:2],))
    rows = {r.name: r for r in plan.layers}
    for block in range(CONFIG.n_layer):
        assert rows[f"transformer.h.{block}.mlp.c_fc"].split == "column"
        assert rows[f"transformer.h.{block}.mlp.c_proj"].split == "row"
        assert rows[f"transformer.h.{block}.attn.c_attn"].split == "column"
        assert "blocks [64, 64, 64]" in rows[f"transformer.h.{block}.attn.c_attn"].note
        assert rows[f"transformer.h.{block}.attn.c_proj"].split == "row"
    # Megatron's minimum: per attention and per MLP, one all-reduce forward and one backward
    assert plan.collectives_per_step == 4 * CONFIG.n_layer
    assert rows["lm_head"].split == "replicated" and "shared" in rows["lm_head"].note


def _train_nanogpt(dropout: float = 0.0):
    x, y = _tokens()
    ref = _gpt(0, dropout)
    model, _ = autodist.parallelize(_gpt(0 if torch.distributed.get_rank() == 0 else 5, dropout), (x, y), mp=2)
    per_rank = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())
    train_alike((ref, model), lambda m: m(x, y)[1])
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict(), per_rank


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_nanogpt_mp2_trains_as_one_process(ranks, dropout):
    # with dropout, attention's dropout_p runs on each rank's heads with its heads' part of one process's mask
    for gathered, expected, per_rank in ranks(2, _train_nanogpt, dropout):
        assert gathered.keys() == expected.keys()
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        assert per_rank <= 0.6  # the attention and MLP weights are split; embeddings and head are whole


def _count_collectives():
    x, y = _tokens()
    model, _ = autodist.parallelize(_gpt(0), (x, y), mp=2)
    return counted(lambda: model(x, y)[1].backward())


def test_nanogpt_mp2_step_runs_the_plans_collectives(ranks):
    x, _ = _tokens()
    planned = autodist.explain(_gpt(0), mp=2, example=(x[:2],)).collectives_per_step
    for calls in ranks(2, _count_collectives):
        assert len(calls) == planned == 4 * CONFIG.n_layer, calls


def _train_nanogpt_dp2_mp2():
    x, y = _tokens()
    ref = _gpt(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, data = autodist.parallelize(_gpt(0), loader, mp=2)
    reference = torch.optim.Adam(ref.parameters(), lr=1e-3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        for xb, yb in data:  # one global batch of 4: 2 rows on each data-parallel rank
            optimizer.zero_grad()
            model(xb, yb)[1].backward()
            optimizer.step()
        reference.zero_grad()
        ref(x, y)[1].backward()
        reference.step()
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict()


def test_nanogpt_dp2_mp2_trains_as_one_process(ranks):
    for gathered, expected in ranks(4, _train_nanogpt_dp2_mp2):
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
