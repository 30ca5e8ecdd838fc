"""``parallelize(..., cp=K, check=loss)``: rank 0 computes one process's gradient of the step's global batch
(every row, the whole sequence) with an ordinary copy of the model and compares it with the synchronized one.
A loss autodist reads (a token-mean cross-entropy over the valid labels) passes; one it cannot weigh (that mean
plus a sum over the tokens) raises at the first step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import _data, _gpt
from torch.utils.data import DataLoader


def _loss(kind: str):
    def language_model(model, batch):
        x, y = batch
        logits, _ = model(x, y)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)
        # "unread": plus a sum over the tokens, which autodist weights as the mean's count (a warning says so)
        return loss if kind == "read" else loss + logits.pow(2).sum() / 1e3
    return language_model


def _checked(kind: str) -> str:
    import autodist

    data = _data(13, 3, "prompt")
    model, loader = autodist.parallelize(_gpt(13), DataLoader(data, batch_size=3), cp=2, check=_loss(kind))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:  # the loop holds the loader's batch in hand, as a training loop does
        _loss(kind)(model, (x, y)).backward()
        try:
            optimizer.step()
        except RuntimeError as error:
            return str(error)
        return "passed"
    return "no batch"


@pytest.mark.slow  # the check itself is in the quick tier (tests/dp/test_check.py)
@pytest.mark.parametrize("kind, says", [("read", "passed"), ("unread", "autodist's check: at step 0 the gradient")])
def test_the_check_compares_one_process_gradient_under_cp(ranks, kind, says):
    for outcome in ranks(2, _checked, kind):
        assert says in outcome, outcome
