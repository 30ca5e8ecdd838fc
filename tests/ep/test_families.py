"""``ep=2`` on the mixture-of-experts families of Hugging Face transformers as they come, each from a tiny config
(8 experts, top-2, every layer sparse, float64, eager attention and experts): 10 AdamW steps on 2 ranks against one
process, every weight within 10x the float64 control (the same training with each batch run in two halves in one
process: 1e-15 where the router computes in float64, 1e-8 to 1e-7 where a family's router computes in float32).
AFMoE's routers start at zeros (every score tied: every token to the same experts, one rank's experts idle in each
layer). The families whose experts are not called with the tokens, their experts and weights are refused by name:
DBRX (its experts' weights flattened into ``(experts x ffn, hidden)`` in a child), JetMoE (experts called with the
tokens sorted by expert and their counts), Llama 4 (every expert run on tokens the router's scores already
scaled)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import workloads as w

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="eager", use_cache=False,
              experts_implementation="eager", output_router_logits=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
SHARED = dict(moe_intermediate_size=12, first_k_dense_replace=0)


def _families() -> dict[str, Callable[[], Any]]:
    t = transformers

    def make(model: Any, config: Any, drop: tuple[str, ...] = (), **fields: Any) -> Callable[[], Any]:
        return lambda: model(config(**{k: v for k, v in {**COMMON, **fields}.items() if k not in drop}))

    return {
        "qwen3_moe": make(t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig, intermediate_size=24, moe_intermediate_size=12,
                          num_experts=8, decoder_sparse_step=1, head_dim=4, router_aux_loss_coef=0.0),
        "olmoe": make(t.OlmoeForCausalLM, t.OlmoeConfig, intermediate_size=12, num_experts=8,
                      router_aux_loss_coef=0.0),
        "deepseek_v3": make(t.DeepseekV3ForCausalLM, t.DeepseekV3Config, intermediate_size=24, n_routed_experts=8,
                            n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                            qk_nope_head_dim=4, v_head_dim=4, n_group=1, topk_group=1, num_key_value_heads=4,
                            **SHARED),
        "granitemoe": make(t.GraniteMoeForCausalLM, t.GraniteMoeConfig, intermediate_size=12, num_local_experts=8,
                           router_aux_loss_coef=0.0),
        "phimoe": make(t.PhimoeForCausalLM, t.PhimoeConfig, intermediate_size=12, num_local_experts=8,
                       router_jitter_noise=0.0, input_jitter_noise=0.0, router_aux_loss_coef=0.0),
        "glm4_moe": make(t.Glm4MoeForCausalLM, t.Glm4MoeConfig, intermediate_size=24, n_routed_experts=8,
                         n_shared_experts=1, n_group=1, topk_group=1, head_dim=4, **SHARED),
        "ernie4_5_moe": make(t.Ernie4_5_MoeForCausalLM, t.Ernie4_5_MoeConfig, ("num_experts_per_tok",),
                             intermediate_size=24, moe_intermediate_size=12, moe_num_experts=8, moe_k=2,
                             moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_end_index=-1,
                             moe_layer_interval=1, router_aux_loss_coef=0.0),
        "minimax": make(t.MiniMaxForCausalLM, t.MiniMaxConfig, intermediate_size=12, num_local_experts=8,
                        head_dim=4, block_size=4, layer_types=["linear_attention", "full_attention"],
                        router_aux_loss_coef=0.0),
        "lfm2_moe": make(t.Lfm2MoeForCausalLM, t.Lfm2MoeConfig, intermediate_size=24, moe_intermediate_size=12,
                         num_experts=8, num_dense_layers=0, layer_types=["conv", "full_attention"]),
        "afmoe": make(t.AfmoeForCausalLM, t.AfmoeConfig, intermediate_size=24, moe_intermediate_size=12,
                      num_experts=8, num_shared_experts=1, num_dense_layers=0, head_dim=4, sliding_window=4,
                      global_attn_every_n_layers=2),
        "jetmoe": make(t.JetMoeForCausalLM, t.JetMoeConfig, ("num_attention_heads",), intermediate_size=12,
                       num_local_experts=8, kv_channels=4, aux_loss_coef=0.0),
        "llama4": make(t.Llama4ForCausalLM, t.Llama4TextConfig, intermediate_size=12, intermediate_size_mlp=24,
                       num_local_experts=8, head_dim=4, interleave_moe_layer_step=1, attention_chunk_size=32),
    }


TRAINED = ["qwen3_moe", "olmoe", "deepseek_v3", "granitemoe", "phimoe", "glm4_moe", "ernie4_5_moe", "minimax",
           "lfm2_moe", "afmoe"]
REFUSED = ["jetmoe", "llama4"]


def _build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return _families()[family]()


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, 32, (40, 6), generator=torch.Generator().manual_seed(1))),
                      batch_size=4)


def _train(model: torch.nn.Module, loader, halves: bool = False) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for (x,) in loader:
        opt.zero_grad()
        for part in (x.chunk(2) if halves else [x]):
            (model(input_ids=part, labels=part).loss * (0.5 if halves else 1.0)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@w.float64
def _against_one_process(family: str) -> tuple[float, float]:
    import autodist

    reference = _train(_build(family), _loader())
    control = max(float((v - reference[k]).abs().max()) for k, v in _train(_build(family), _loader(), True).items())
    model, loader = autodist.parallelize(_build(family), _loader(), ep=2)
    _train(model, loader)
    trained = autodist.gather_state_dict(model, all_ranks=True)
    return max(float((trained[k] - v).abs().max()) for k, v in reference.items()), control


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINED)
def test_each_family_trains_as_one_process_at_ep2(ranks, family):
    for worst, control in ranks(2, _against_one_process, family):
        print(f"{family}: {worst:.2e} (control {control:.2e})")
        assert worst <= 10 * max(control, 1e-15), (worst, control)


@w.float64
def _refused(family: str) -> str:
    import autodist

    try:
        autodist.parallelize(_build(family), _loader(), ep=2)
    except ValueError as err:
        return str(err)
    return "not refused"


@pytest.mark.slow
@pytest.mark.parametrize("family", REFUSED)
def test_experts_called_another_way_are_refused_by_name(ranks, family):
    for said in ranks(2, _refused, family):
        assert "has none" in said and "Leave ep=1" in said, said
