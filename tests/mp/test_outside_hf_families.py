"""More Hugging Face transformer families, each from a tiny config: mp=2 splits their attention and MLPs and
trains exactly as one process (float64 Adam, gathered state dict, original keys).

The mechanism is not a list of class names: GPT-NeoX's fused QKV holds each head's q, k and v together
(one block, whole heads per rank), Mistral / Qwen2 / Gemma use grouped-query attention, OPT / Phi /
RoBERTa / DistilBERT separate projections with biases, Falcon multi-query attention (one key/value head:
its fused projection cannot be cut by heads and stays whole, the MLP is split).
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autodist
from alike import train_alike

T = pytest.importorskip("transformers")
SMALL = dict(vocab_size=96, max_position_embeddings=40)
FAMILIES = {
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4,
                                                             hidden_size=64, intermediate_size=128, **SMALL)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, hidden_size=64,
                                                            intermediate_size=128, **SMALL)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                                      **SMALL)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                                      head_dim=16, **SMALL)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                                ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, **SMALL)),
    "phi": lambda: T.PhiForCausalLM(T.PhiConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                                intermediate_size=128, resid_pdrop=0.0, embd_pdrop=0.0, **SMALL)),
    "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                                         hidden_dropout=0.0, attention_dropout=0.0, vocab_size=96)),
    "roberta": lambda: T.RobertaForMaskedLM(T.RobertaConfig(num_hidden_layers=2, num_attention_heads=4,
                                                            hidden_size=64, intermediate_size=128,
                                                            hidden_dropout_prob=0.0,
                                                            attention_probs_dropout_prob=0.0, **SMALL)),
    "distilbert": lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(n_layers=2, n_heads=4, dim=64, hidden_dim=128,
                                                                     dropout=0.0, attention_dropout=0.0, **SMALL)),
}


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 96, (4, 10), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def _train(kind: str):
    batch = _batch()
    torch.manual_seed(0)
    ref = FAMILIES[kind]().double()
    torch.manual_seed(0)
    model, _ = autodist.parallelize(FAMILIES[kind]().double(), mp=2, example={k: v[:2] for k, v in batch.items()})
    split = sum(p.numel() for p in ref.parameters()) - sum(p.numel() for p in model.parameters())
    train_alike((ref, model), lambda m: m(**batch).loss, steps=2)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict(), split


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_mp2_trains_as_one_process(ranks, kind):
    for gathered, expected, split in ranks(2, _train, kind):
        assert split > 0
        assert gathered.keys() == expected.keys()
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["gpt_neox", "mistral", "opt", "distilbert"])
def test_every_attention_is_split(kind):
    batch = _batch()
    plan = autodist.explain(FAMILIES[kind]().double(), mp=2, example={k: v[:2] for k, v in batch.items()})
    rows = [r for r in plan.layers if r.op in ("Linear", "Conv1D")]
    attention = [r for r in rows if any(w in r.name for w in ("attn", "attention"))]
    assert len(attention) >= 2 * 2 and all(r.split in ("column", "row") for r in attention), \
        [(r.name, r.split, r.note) for r in attention]
