"""plan="auto" with ``mixed_precision=``: every candidate computes in it, planned with its bytes (the forward and
backward measured in it; the blocks ``shard="parameters"`` gathers, in it), and the layout chosen trains in it, as
that layout written by hand does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from outside.nanogpt import GPT, GPTConfig


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), *[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh())
                                             for _ in range(3)], nn.Linear(16, 3))


def _train(model: nn.Module, batches) -> tuple[dict, set]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dtypes = set()
    for x, y in batches:
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out.float(), y).backward()
        dtypes.add(out.dtype)
        opt.step()
    return autodist.gather_state_dict(model, all_ranks=True), dtypes


def _planned_in_bf16():
    x, y = w.digits_like(24)
    plan = autodist.plan(w.seeded(_build, 0), w.loader(x, y, 8, shuffle=False), mixed_precision="bf16")
    model, loader = autodist.parallelize(w.seeded(_build, 0), w.loader(x, y, 8, shuffle=False), plan=plan)
    planned = _train(model, loader)
    model, loader = autodist.parallelize(w.seeded(_build, 0), w.loader(x, y, 8, shuffle=False), layout=plan.layout)
    return plan.to_json(), planned, _train(model, loader)


def test_a_plan_in_bf16_trains_in_bf16_as_its_layout_written_by_hand(ranks):
    for text, (planned, planned_dtypes), (by_hand, dtypes) in ranks(2, _planned_in_bf16):
        plan = autodist.ParallelPlan.from_json(text)
        assert plan.layout.precision == "bf16" and {r.layout.precision for r in plan.rows} == {"bf16"}
        assert "computing in bf16" in str(plan)
        assert planned_dtypes == dtypes == {torch.bfloat16}
        assert all(v.dtype == torch.float32 for v in planned.values())  # the float32 master
        assert_close(planned, by_hand, rtol=0, atol=0)


def _nanogpt_plans():
    config = GPTConfig(block_size=32, vocab_size=96, n_layer=3, n_head=4, n_embd=64, dropout=0.0)
    tokens = torch.randint(0, 96, (64, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=16)
    plans = {}
    for option in (None, "bf16"):
        plans[option] = autodist.plan(w.seeded(lambda: GPT(config), 0), loader, autodist.Auto(finalists=4),
                                      mixed_precision=option)
    return {option: ([(str(r.layout), r.memory.get("activations"), r.peak, r.measured_peak, r.microbatches)
                      for r in plan.rows if not r.impossible], str(plan)) for option, plan in plans.items()}


@pytest.mark.slow
def test_bf16_is_planned_with_its_bytes_within_10_percent_of_the_measured(ranks):
    plans = ranks(2, _nanogpt_plans)[0]
    print(plans["bf16"][1])
    rows = plans["bf16"][0]
    measured = [(layout, peak, real) for layout, _, peak, real, _ in rows if real]
    assert len(measured) == 4
    for layout, predicted, real in measured:
        assert abs(predicted / real - 1) <= 0.10, (layout, predicted, real)
    # the activations measured in bfloat16: well under float32's (about 0.6x here), the layouts the same; a
    # pipeline's stage keeps each micro-batch's casts of its parameters on top (at 2 x pp micro-batches under
    # 0.9x; at 4 x pp the casts of 8 micro-batches outgrow what bfloat16 saves on this small model)
    for (layout, low, _, _, m), (same, full, _, _, m_same) in zip(rows, plans[None][0]):
        assert layout == same + ", precision='bf16'" and m == m_same, (layout, same)
        if "pp=" not in layout or m == 4:
            assert low < (0.75 if "pp=" not in layout else 0.9) * full, (layout, low, full)
