"""The planner counts bytes by dtype: a bfloat16 model's parameters, gradients and Adam state take half of a
float32 one's, and its gradient buckets are float32 (the ranks sum bfloat16 gradients in float32)."""
from __future__ import annotations

import torch
from torch import nn

from autodist.planner.memory import replicated_need


def test_a_bfloat16_model_needs_half_but_its_float32_buckets():
    float32 = replicated_need(nn.Linear(1000, 1000), dp=2)
    bfloat16 = replicated_need(nn.Linear(1000, 1000).to(torch.bfloat16), dp=2)
    weights = 1001 * 1000
    assert float32 == weights * 4 * (1 + 1 + 2 + 1)
    assert bfloat16 == weights * 2 * (1 + 1 + 2) + weights * 4  # parameters, gradients, Adam; buckets
    assert replicated_need(nn.Linear(1000, 1000).to(torch.bfloat16), dp=1) == weights * 2 * 4  # no buckets
