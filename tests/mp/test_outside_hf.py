"""Model parallelism on Hugging Face transformers built from tiny configs (no weights are downloaded).

GPT-2's layers are ``Conv1D`` (``x @ W + b``, the weight held transposed), found affine on the sample batch;
its fused ``c_attn`` is split in three blocks (each rank's heads of q, k and v), the head views, transposes
and attention (SDPA or the eager softmax(q k^T) v) run on those heads. BERT's separate query/key/value layers
share one backward all-reduce. Llama (a tiny config) brings grouped-query attention (2 kv heads for 4 query
heads: each rank takes one kv head and its two query heads), rotary embeddings applied on the local heads,
RMSNorm and the gated SwiGLU MLP (``down(silu(gate(x)) * up(x))``). T5 adds a relative position bias per head,
computed once and held whole on every rank: each rank adds its heads' part of it (and backward gathers its
gradient), and cross-attention on the encoder's output. All train with mp=2 exactly as one
process (float64, Adam).
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autodist
from alike import train_alike
from collectives import counted

transformers = pytest.importorskip("transformers")


def _gpt2(impl: str, dropout: float = 0.0) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=96, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     attn_implementation=impl)
    return transformers.GPT2LMHeadModel(config).double()


def _bert(impl: str) -> torch.nn.Module:
    config = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                     intermediate_size=128, vocab_size=96, max_position_embeddings=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation=impl)
    return transformers.BertForSequenceClassification(config).double()


def _llama(impl: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=64, intermediate_size=128, vocab_size=96,
                                      max_position_embeddings=32, attn_implementation=impl)
    return transformers.LlamaForCausalLM(config).double()


def _t5(impl: str) -> torch.nn.Module:
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=64, d_kv=16, d_ff=128,
                                   vocab_size=96, decoder_start_token_id=0, dropout_rate=0.0,
                                   attn_implementation=impl)
    return transformers.T5ForConditionalGeneration(config).double()


def _batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (4, 10), generator=g)
    return {"input_ids": ids, "labels": ids if kind != "bert" else torch.tensor([0, 1, 1, 0])}


BUILD = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "t5": _t5}


@pytest.mark.parametrize("kind,impl", [("gpt2", "sdpa"), ("gpt2", "eager"), ("bert", "sdpa"), ("bert", "eager"),
                                       ("llama", "sdpa"), ("llama", "eager"), ("t5", "sdpa")])
def test_plan_splits_every_attention_and_mlp(kind, impl):
    batch = _batch(kind)
    torch.manual_seed(0)
    plan = autodist.explain(BUILD[kind](impl), mp=2, example={k: v[:2] for k, v in batch.items()})
    splits = {r.name: r.split for r in plan.layers}
    for block in range(2):
        if kind == "gpt2":
            names = {f"transformer.h.{block}.attn.c_attn": "column", f"transformer.h.{block}.attn.c_proj": "row",
                     f"transformer.h.{block}.mlp.c_fc": "column", f"transformer.h.{block}.mlp.c_proj": "row"}
        elif kind == "t5":
            names = {}
            for stack, attentions in (("encoder", ("0.SelfAttention",)),
                                      ("decoder", ("0.SelfAttention", "1.EncDecAttention"))):
                for attention in attentions:
                    at = f"{stack}.block.{block}.layer.{attention}"
                    names |= {f"{at}.{n}": "column" for n in "qkv"} | {f"{at}.o": "row"}
                ff = f"{stack}.block.{block}.layer.{len(attentions)}.DenseReluDense"
                names |= {f"{ff}.wi": "column", f"{ff}.wo": "row"}
        elif kind == "llama":
            layer = f"model.layers.{block}"
            names = {f"{layer}.self_attn.{n}_proj": "column" for n in "qkv"} | {f"{layer}.self_attn.o_proj": "row"}
            names |= {f"{layer}.mlp.gate_proj": "column", f"{layer}.mlp.up_proj": "column",
                      f"{layer}.mlp.down_proj": "row"}
        else:
            layer = f"bert.encoder.layer.{block}"
            names = {f"{layer}.attention.self.{n}": "column" for n in ("query", "key", "value")}
            names |= {f"{layer}.attention.output.dense": "row", f"{layer}.intermediate.dense": "column",
                      f"{layer}.output.dense": "row"}
        assert {n: splits[n] for n in names} == names
    # Megatron's minimum per block: one all-reduce forward and one backward for attention and for the MLP
    # (BERT adds its pooler -> classifier pair, Llama its untied LM head split inside: one all-reduce forward,
    # one all-gather backward)
    if kind == "t5":  # per block: encoder 4; decoder 7 (cross-attention's query and memory enter separately);
        # and each self-attention cuts its heads of the position bias (one all-gather backward)
        assert plan.collectives_per_step == 2 * 4 + 2 * 7 + 4
    else:
        assert plan.collectives_per_step == 4 * 2 + (2 if kind in ("bert", "llama") else 0)


def _train(kind: str, impl: str, *options: float):
    batch = _batch(kind)
    torch.manual_seed(0)
    ref = BUILD[kind](impl, *options)
    torch.manual_seed(0 if torch.distributed.get_rank() == 0 else 7)  # rank 0's weights are the ones kept
    model, _ = autodist.parallelize(BUILD[kind](impl, *options), mp=2, example={k: v[:2] for k, v in batch.items()})
    per_rank = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())
    train_alike((ref, model), lambda m: m(**batch).loss)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict(), per_rank


@pytest.mark.parametrize("kind,impl,options", [("gpt2", "sdpa", ()), ("gpt2", "eager", ()), ("bert", "sdpa", ()),
                                               ("llama", "sdpa", ()), ("gpt2", "eager", (0.1,)),
                                               ("gpt2", "sdpa", (0.1,)), ("t5", "sdpa", ()), ("t5", "eager", ())])
def test_mp2_trains_as_one_process(ranks, kind, impl, options):
    # with dropout (0.1 on embeddings, attention probabilities and residuals): the attention's dropout runs on
    # each rank's heads, with its heads' part of the mask one process draws
    for gathered, expected, per_rank in ranks(2, _train, kind, impl, *options):
        assert gathered.keys() == expected.keys()
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        assert per_rank < 0.75


def _train_padded():
    """Llama on a left-padded batch: with a mask, Hugging Face repeats each kv head for its query heads itself
    (``repeat_kv``), one kv head on each rank here."""
    batch = _batch("llama")
    batch["attention_mask"] = (torch.arange(10) >= torch.tensor([[0], [3], [6], [1]])).long()
    torch.manual_seed(0)
    ref = _llama("sdpa")
    torch.manual_seed(0)
    model, _ = autodist.parallelize(_llama("sdpa"), mp=2, example={k: v[:2] for k, v in batch.items()})
    train_alike((ref, model), lambda m: m(**batch).loss)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict()


def test_grouped_query_heads_repeated_by_the_model_train_as_one_process(ranks):
    for gathered, expected in ranks(2, _train_padded):
        assert max((gathered[n] - expected[n]).abs().max().item() for n in expected) <= 1e-12


def _mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="eager",
                                        experts_implementation="eager", use_cache=False)
    return transformers.MixtralForCausalLM(config).double()


def _train_mixtral():
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = _mixtral()
    torch.manual_seed(0)
    model, _ = autodist.parallelize(_mixtral(), mp=2, example={"input_ids": ids[:2], "labels": ids[:2]})
    train_alike((ref, model), lambda m: m(input_ids=ids, labels=ids).loss)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict()


@pytest.mark.slow
def test_mixtral_splits_its_attention_and_keeps_its_experts_whole_saying_so(ranks):
    """Mixtral's experts are one fused 3-D parameter each (not Linears): mp splits its attention (grouped-query,
    repeat_kv of one kv head a rank) and keeps the experts whole, which the plan names; it trains as one
    process."""
    ids = torch.randint(0, 64, (2, 16))
    shown = str(autodist.explain(_mixtral(), mp=2, example={"input_ids": ids, "labels": ids}))
    assert "kept whole on every rank, not layers mp splits" in shown and "model.layers.0.mlp.experts (24,576)" in \
        shown, shown
    for gathered, expected in ranks(2, _train_mixtral):
        assert max((gathered[n] - expected[n]).abs().max().item() for n in expected) <= 1e-12


def _count_t5_collectives():
    batch = _batch("t5")
    model, _ = autodist.parallelize(_t5("sdpa"), mp=2, example={k: v[:2] for k, v in batch.items()})
    return counted(lambda: model(**batch).loss.backward())


def test_t5_step_runs_the_plans_collectives(ranks):
    batch = _batch("t5")
    planned = autodist.explain(_t5("sdpa"), mp=2, example={k: v[:2] for k, v in batch.items()})
    for calls in ranks(2, _count_t5_collectives):
        assert len(calls) == planned.collectives_per_step, calls
        # the four self-attentions' position-bias cuts (the tied LM head stays whole)
        assert calls.count("all_gather") + calls.count("all_gather_into_tensor") == 4
