"""``explain`` prints the plan ``parallelize`` applies, or says it cannot know: for every model family the suite
knows (its own models, nanoGPT, torch's Transformer layers, Hugging Face tiny configs), with and without an
example, the layers explain plans to split are the layers parallelize replaces, split the same way; where a
sample is needed and none is given, both raise the same error asking for one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autodist
import workloads as w
from autodist.layers import ColumnParallelLinear, MPBaseLinear, RowParallelLinear
from autodist.layers.attention import MPMultiheadAttention
from autodist.mp.rewrite import mp_modules
from outside.nanogpt import GPT, GPTConfig
from outside.word_language_model import TransformerModel

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()


class EncoderClassifier(nn.Module):
    """The reported model: an embedding, torch's TransformerEncoder (batch_first), a mean-pool, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
FAMILIES = {
    "mlp": (w.mlp, (torch.randn(2, 6),)),
    "nanogpt": (lambda: GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=2, n_head=2, n_embd=16, dropout=0.0)),
                (IDS,)),
    "torch encoder classifier": (EncoderClassifier, (IDS,)),
    "word_language_model Transformer": (lambda: TransformerModel(50, 32, 4, 64, 2, dropout=0.0), (IDS.t(),)),
    "hf gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50,
                                                       n_positions=16)), {"input_ids": IDS}),
    "hf llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                                                          vocab_size=50, max_position_embeddings=16)),
                 {"input_ids": IDS}),
    "hf qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                                                          vocab_size=50, max_position_embeddings=16)),
                 {"input_ids": IDS}),
    "hf mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(num_hidden_layers=2, num_attention_heads=4,
                                                                num_key_value_heads=2, hidden_size=32,
                                                                intermediate_size=64, vocab_size=50,
                                                                max_position_embeddings=16)),
                   {"input_ids": IDS}),
    "hf bert": (lambda: T.BertModel(T.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                 intermediate_size=64, vocab_size=50, max_position_embeddings=16)),
                {"input_ids": IDS}),
    "hf vit": (lambda: T.ViTModel(T.ViTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                              intermediate_size=64, image_size=8, patch_size=4)),
               {"pixel_values": torch.randn(2, 3, 8, 8)}),
    "hf t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(num_layers=2, num_heads=4, d_model=32, d_kv=8, d_ff=64,
                                                              vocab_size=50)),
              {"input_ids": IDS, "decoder_input_ids": IDS}),
}
SPLITS = {ColumnParallelLinear: "column", RowParallelLinear: "row", MPBaseLinear: "full", MPMultiheadAttention: "heads"}


def _planned(plan) -> dict[str, str]:
    return {r.name: r.split for r in plan.layers if r.split in SPLITS.values()}


def _replaced(model: nn.Module) -> dict[str, str]:
    """The MP layers parallelize swapped in (an attention split by heads carries its out_proj: one plan row)."""
    layers = {name: next((s for cls, s in SPLITS.items() if isinstance(m, cls)), type(m).__name__)
              for name, m in mp_modules(model)}
    heads = [name for name, split in layers.items() if split == "heads"]
    return {name: split for name, split in layers.items() if not any(name.startswith(h + ".") for h in heads)}


def _outcome(attempt) -> dict[str, str] | str:
    try:
        return attempt()
    except ValueError as e:
        return f"ValueError: {str(e).split(':')[0]}"


def _compare(kind: str):
    build, example = FAMILIES[kind]
    outcomes = {}
    for given in (None, example):
        planned = _outcome(lambda: _planned(autodist.explain(w.seeded(build, 0), mp=2, example=given)))

        def run():
            model = w.seeded(build, 0)
            autodist.parallelize(model, mp=2, example=given)
            return _replaced(model)
        outcomes["with an example" if given is not None else "without"] = (planned, _outcome(run))
    return outcomes


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_explain_prints_the_plan_parallelize_applies(ranks, kind):
    for outcomes in ranks(2, _compare, kind):
        for given, (planned, replaced) in outcomes.items():
            if isinstance(planned, dict) and not planned:  # nothing to split: parallelize refuses mp=2
                assert replaced == "ValueError: mp=2 splits none of", (given, replaced)
            else:
                assert planned == replaced, (given, planned, replaced)
        planned = outcomes["with an example"][0]
        assert isinstance(planned, dict) and planned, planned  # every family splits given a sample
        if kind.startswith("hf ") or kind == "mlp":  # these need none: traced, or their own sample inputs
            assert outcomes["without"][0] == planned


def _from_its_loader():
    x, y = IDS.repeat(4, 1), torch.arange(8) % 3
    model, _ = autodist.parallelize(w.seeded(EncoderClassifier, 0), w.loader(x, y, 4, shuffle=False), mp=2)
    return _replaced(model)


def test_the_reported_classifier_asks_for_an_example_instead_of_printing_another_plan(ranks):
    with pytest.raises(ValueError, match="depends on one forward on a sample batch .* pass example="):
        autodist.explain(EncoderClassifier(), mp=2)
    planned = _planned(autodist.explain(EncoderClassifier(), mp=2, example=(IDS[:2],)))
    assert sorted(planned.values()) == ["column", "column", "full", "heads", "heads", "row", "row"]  # seven
    for replaced in ranks(2, _from_its_loader):  # the plan parallelize reads from the loader's first rows
        assert replaced == planned


# -- Hugging Face models with no example: their own sample inputs, or their loader's ---------------------------

def _rows(kind: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 50, (4, 8), generator=g)
    if kind == "vit":
        return [{"pixel_values": torch.randn(3, 8, 8, generator=g), "labels": torch.tensor(i % 3)} for i in range(4)]
    return [{"input_ids": row, "labels": row} for row in ids]


HF_TRAINED = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                      hidden_size=32, intermediate_size=64, vocab_size=50,
                                                      max_position_embeddings=16)),
    "bert": lambda: T.BertForMaskedLM(T.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                   intermediate_size=64, vocab_size=50, max_position_embeddings=16,
                                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(num_hidden_layers=2, num_attention_heads=4,
                                                           hidden_size=32, intermediate_size=64, image_size=8,
                                                           patch_size=4, num_labels=3, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(num_layers=2, num_heads=4, d_model=32, d_kv=8, d_ff=64,
                                                          vocab_size=50, dropout_rate=0.0, decoder_start_token_id=0,
                                                          pad_token_id=0)),
}


def _hf_without_example(kind: str, source: str):
    """mp=2 with no example=: from the loader (T5's yields (input_ids, labels) tuples, the others dict
    batches), or with no data at all (the model's own sample inputs); three Adam steps against one process."""
    from torch.utils.data import DataLoader

    from alike import train_alike

    rows = _rows(kind)
    loader = DataLoader([(r["input_ids"], r["labels"]) for r in rows] if kind == "t5" else rows, batch_size=4)
    batch = next(iter(loader))
    kwargs = {"input_ids": batch[0], "labels": batch[1]} if kind == "t5" else batch
    ref = w.seeded(lambda: HF_TRAINED[kind]().double(), 0)
    model, _ = autodist.parallelize(w.seeded(lambda: HF_TRAINED[kind]().double(), 0),
                                    loader if source == "loader" else None, mp=2)
    train_alike((ref, model), lambda m: m(**kwargs).loss, steps=3)
    return autodist.gather_state_dict(model, all_ranks=True), ref.state_dict(), len(mp_modules(model))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["loader", "nothing"])
@pytest.mark.parametrize("kind", list(HF_TRAINED))
def test_hugging_face_models_parallelize_with_no_example_as_one_process(ranks, kind, source):
    for gathered, expected, split in ranks(2, _hf_without_example, kind, source):
        assert split >= 8, split  # attention and MLP of both layers
        assert gathered.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}: {m}")
