"""plan="auto" searches expert parallelism for a mixture of experts (a Hugging Face Mixtral, 8 experts top-2, 2 ranks):
every ``ep`` dividing ``dp`` is a candidate, a rank's experts counted at ``1/ep`` and never sharded further, its
activations measured with its experts computed as a rank of ``ep`` computes them (Hugging Face's loop over every
expert makes a gradient the size of all of them for each one's slice: a rank of ``ep=2`` holds half); the finalists'
predicted peaks within 10% of the measured, with ``ep`` and without; a budget only ``ep`` layouts fit picks one and
the measured peak fits it; ``ep=2`` beside ``plan=`` is kept, and the chosen layout trains as one process (float64)."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
import workloads as w

transformers = pytest.importorskip("transformers")


def _moe() -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_local_experts=8,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="eager",
                                        use_cache=False, experts_implementation="eager")
    return transformers.MixtralForCausalLM(config)


def _loader() -> DataLoader:
    ids = torch.randint(0, 128, (24, 32), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=8)


def _train(model: torch.nn.Module, batches) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for (x,) in batches:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return dict(autodist.gather_state_dict(model, all_ranks=True)) if autodist.world_size() > 1 else w.state(model)


def _plans():
    free = autodist.plan(w.seeded(_moe, 0), _loader(), autodist.Auto(finalists=6))
    fitting = [r for r in free.rows if not r.impossible]
    experts_only = max(r.peak for r in fitting if r.layout.ep > 1 and not r.layout.checkpoint)
    others = min(r.peak for r in fitting if r.layout.ep == 1 and r.layout.pp == 1)  # pipelines may fit too
    budget = (experts_only + others) / 2 if others > experts_only else None
    tight = autodist.plan(w.seeded(_moe, 0), _loader(), autodist.Auto(budget_gb=budget / 1e9)) if budget else None
    return free.to_json(), tight.to_json() if tight else None, budget


@pytest.mark.slow
def test_expert_parallelism_is_searched_and_predicted(ranks):
    expert_bytes = sum(p.numel() * p.element_size() for name, p in _moe().named_parameters() if ".experts." in name)
    whole = sum(p.numel() * p.element_size() for p in _moe().parameters())
    for free_text, tight_text, budget in ranks(2, _plans):
        free = autodist.ParallelPlan.from_json(free_text)
        print(free)
        placed = [r for r in free.rows if r.layout.ep == 2 and not r.impossible]
        assert {(r.layout.shard, r.layout.checkpoint) for r in placed} == {
            (s, c) for s in (None, "optimizer", "gradients", "parameters") for c in (False, True)}
        for r in placed:  # the dense parameters whole (sharded under shard="parameters"), a rank's half of the experts
            if r.layout.shard != "parameters":
                assert abs(r.memory["parameters"] - (whole - expert_bytes / 2)) < 1, r.label
        measured = [r for r in free.rows if r.measured_peak and r.layout.pp == 1]
        assert any(r.layout.ep == 2 for r in measured) and any(r.layout.ep == 1 for r in measured)
        for r in measured:
            assert abs(r.peak / r.measured_peak - 1) <= 0.10, (r.label, r.peak, r.measured_peak)
        assert budget is not None, "every layout without ep needs less than the ep layouts here"
        tight = autodist.ParallelPlan.from_json(tight_text)
        chosen = next(r for r in tight.rows if r.status == "chosen")
        assert chosen.measured_peak is not None and chosen.measured_peak <= budget
        assert all(not r.fits for r in tight.rows if r.layout.ep == 1 and r.layout.pp == 1), str(tight)


@w.float64
def _kept_and_trained():
    reference = _train(w.seeded(_moe, 0), _loader())
    plan = autodist.plan(w.seeded(_moe, 0), _loader(), autodist.Auto(finalists=2), ep=2)
    model, loader = autodist.parallelize(w.seeded(_moe, 0), _loader(), plan=plan)
    held = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return plan.to_json(), held, reference, _train(model, loader)


@pytest.mark.slow
def test_ep_beside_the_plan_is_kept_and_trains_as_one_process(ranks):
    experts = sum(p.numel() for name, p in _moe().named_parameters() if ".experts." in name)
    for text, held, reference, trained in ranks(2, _kept_and_trained):
        plan = autodist.ParallelPlan.from_json(text)
        assert plan.layout.ep == 2 and {r.layout.ep for r in plan.rows} == {2}
        assert held == experts // 2  # this rank's half of every layer's experts
        assert_close(trained, reference, rtol=0, atol=1e-10)
