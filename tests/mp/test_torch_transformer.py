"""Model parallelism on torch's own Transformer layers: ``nn.MultiheadAttention`` split by heads, the
feed-forward Linears of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` split as Megatron pairs.

Every case trains with mp=2 as one process does (float64 Adam, dropout 0.1 on: each rank drops its part of
one process's mask), and an evaluation forward under ``torch.no_grad()`` - where torch would take its fused
fast path, which reads the dense weights - gives one process's output.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import autodist
from alike import train_alike
from autodist.layers.attention import MPMultiheadAttention

VOCAB, WIDTH, HEADS = 40, 32, 4


class Encoder(nn.Module):
    """A seq-first (the torch default) encoder LM with a padding mask."""

    def __init__(self, batch_first: bool, dropout: float = 0.1) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=dropout, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0
        x = self.embed(tokens if self.batch_first else tokens.t())
        return self.head(self.encoder(x, src_key_padding_mask=padding))


class Seq2Seq(nn.Module):
    """nn.Transformer: encoder, decoder with causal self-attention and cross-attention on the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, HEADS, 1, 1, 2 * WIDTH, dropout=0.1, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=torch.float64)
        x = self.embed(tokens)
        return self.head(self.transformer(x, x, tgt_mask=causal, tgt_is_causal=True))


BUILD = {"encoder": lambda: Encoder(False), "encoder_batch_first": lambda: Encoder(True),
         # no dropout: no hook on the layers, so only the split attention keeps torch's fused path off
         "encoder_no_dropout": lambda: Encoder(True, dropout=0.0), "seq2seq": Seq2Seq}


def _tokens() -> torch.Tensor:
    tokens = torch.randint(1, VOCAB, (4, 9), generator=torch.Generator().manual_seed(2))
    tokens[1, -3:] = 0  # padding
    return tokens


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return BUILD[kind]().double()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    if logits.shape[0] != tokens.shape[0]:  # seq-first
        logits = logits.transpose(0, 1)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


@pytest.mark.parametrize("kind", list(BUILD))
def test_plan_splits_attention_by_heads_and_feed_forward_in_pairs(kind):
    plan = autodist.explain(_model(kind, 0), mp=2, example=(_tokens()[:2],))
    splits = {r.name: r.split for r in plan.layers}
    attentions = [n for n, m in _model(kind, 0).named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert attentions and all(splits[n] == "heads" for n in attentions)
    linear1 = [n for n in splits if n.endswith("linear1")]
    assert linear1 and all(splits[n] == "column" and splits[n[:-1] + "2"] == "row" for n in linear1)


def _train(kind: str, directory: str):
    tokens = _tokens()
    ref = _model(kind, 0)
    model, _ = autodist.parallelize(_model(kind, 0 if torch.distributed.get_rank() == 0 else 9), mp=2,
                                    example=(tokens[:2],))
    assert sum(isinstance(m, MPMultiheadAttention) for m in model.modules()) == \
        sum(isinstance(m, nn.MultiheadAttention) for m in ref.modules())
    optimizer = train_alike((ref, model), lambda m: _loss(m, tokens))[1]
    evaluated = []
    for m in (ref, model):
        m.eval()
        with torch.no_grad():  # torch's fused fast path would read the dense weights here
            evaluated.append(m(tokens))
    per_rank = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())
    # a checkpoint of the split attention loads into the plain model
    path = f"{directory}/ckpt.pt"
    autodist.save(path, model, optimizer)
    plain = _model(kind, 3)
    autodist.load(path, plain)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict(), evaluated, per_rank, \
        plain.state_dict()


@pytest.mark.parametrize("kind", list(BUILD))
def test_mp2_trains_as_one_process(ranks, kind, tmp_path):
    for gathered, expected, (ref_out, out), per_rank, loaded in ranks(2, _train, kind, str(tmp_path)):
        for name in expected:
            assert_close(loaded[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        assert gathered.keys() == expected.keys()
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        padded = _tokens().t() == 0 if kind == "encoder" else _tokens() == 0
        keep = ~padded if kind.startswith("encoder") else torch.ones_like(padded)
        # (torch's nested-tensor fast path leaves padded positions 0 where the plain path computes them)
        assert_close(out[keep], ref_out[keep], rtol=1e-9, atol=1e-12)
        assert per_rank < 0.8


def _need_weights():
    torch.manual_seed(0)
    dense = nn.MultiheadAttention(WIDTH, HEADS, dropout=0.2).double()
    split = MPMultiheadAttention.from_dense(dense)
    x = torch.randn(5, 3, WIDTH, dtype=torch.float64, requires_grad=True)
    out = []
    for m in (dense, split):
        for average in (True, False):
            torch.manual_seed(4)
            y, w = m(x, x, x, average_attn_weights=average)
            (grad,) = torch.autograd.grad((y.sum() + (w * w).sum()), x)
            out.append((y.detach(), w.detach(), grad))
    return out


def test_attention_weights_are_the_dense_ones(ranks):
    for out in ranks(2, _need_weights):
        for dense, split in zip(out[:2], out[2:]):
            for a, b in zip(dense, split):
                assert_close(b, a, rtol=1e-9, atol=1e-12)


def test_attention_that_cannot_be_split_stays_whole_and_says_why():
    model = nn.Sequential(nn.TransformerEncoderLayer(30, 3, 64), nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 30))
    plan = autodist.explain(model, mp=2, example=(torch.randn(5, 2, 30),))
    rows = {r.name: r for r in plan.layers}
    assert rows["0.self_attn"].split == "replicated" and "3 heads do not divide by mp=2" in rows["0.self_attn"].note
    assert rows["0.linear1"].split == "replicated" and "fused inference path" in rows["0.linear1"].note
    assert rows["1"].split == "column" and rows["3"].split == "row"
