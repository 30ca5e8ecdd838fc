"""Copies and EMAs of outside models after parallelize: nanoGPT's GPT and Hugging Face GPT-2 and Llama (tiny
configs, nothing downloaded). An EMA of nanoGPT trained at shard="parameters" is one process's EMA; a deep copy
at mp=2 is the dense model (Llama's rotary buffers, which its state dict leaves out, taken along) computing what
the split model computes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.testing import assert_close

import autodist
import workloads as w
from outside.nanogpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


def _nanogpt() -> torch.nn.Module:
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True))


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
        vocab_size=64, max_position_embeddings=32))


BUILD = {"nanogpt": _nanogpt, "gpt2": _gpt2, "llama": _llama}


def _logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out[0] if isinstance(out, tuple) else getattr(out, "logits", out)


def _ema_run(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for idx in batches:
        opt.zero_grad()
        _logits(model, idx).pow(2).mean().backward()
        opt.step()
        with autodist.full_parameters(model):
            ema.update_parameters(model)
    return ema.module.state_dict()


def _nanogpt_ema():
    torch.set_default_dtype(torch.float64)
    try:
        n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(3)]
        ref = _ema_run(w.seeded(_nanogpt, 0), batches)
        model, _ = autodist.parallelize(w.seeded(_nanogpt, 0), shard="parameters")
        got = _ema_run(model, [b[rank * 4 // n:(rank + 1) * 4 // n] for b in batches])
        return ref, got
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_ema_of_nanogpt_at_shard_parameters_is_one_process_ema(ranks):
    for ref, got in ranks(2, _nanogpt_ema):
        assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _split_copy(kind: str, options: dict):
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model, _ = autodist.parallelize(w.seeded(BUILD[kind], 0), example=(idx,) if options.get("mp") else None,
                                    **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _logits(model, idx).pow(2).mean().backward()
    opt.step()
    twin = copy.deepcopy(model)
    dense = autodist.gather_state_dict(model, all_ranks=True)
    model.eval()
    twin.eval()
    with torch.no_grad():
        return {"class": type(twin).__name__, "state": twin.state_dict(), "dense": dense,
                "out": _logits(twin, idx), "model_out": _logits(model, idx),
                "split": [type(m).__name__ for m in twin.modules() if type(m).__module__.startswith("autodist")]}


@pytest.mark.parametrize("kind,options", [("llama", {"mp": 2}), ("gpt2", {"mp": 2}), ("nanogpt", {"mp": 2}),
                                          ("llama", {"shard": "parameters"})],
                         ids=["llama-mp2", "gpt2-mp2", "nanogpt-mp2", "llama-parameters"])
def test_a_deep_copy_of_an_outside_model_is_the_dense_model(ranks, kind, options):
    for out in ranks(2, _split_copy, kind, options):
        assert out["split"] == [] and out["class"] == type(BUILD[kind]()).__name__
        assert set(out["state"]) == set(out["dense"])
        assert_close(out["state"], out["dense"], rtol=0, atol=0)
        assert_close(out["out"], out["model_out"], rtol=1e-5, atol=1e-6)
