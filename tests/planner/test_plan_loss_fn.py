"""plan="auto" with ``loss_fn=``, the loop ``loss = model(x, target=y)``: every layout runs that loop (without
``pp`` the model returns ``loss_fn(model(x), y)``, as in one process), its pipelines are planned and tried as 1F1B
(a stage holds at most ``pp - s`` micro-batches' activations: less than GPipe's every one), the plan says so and
is refused by a loop without ``loss_fn=``, and the layout chosen trains as one process (float64, 2 ranks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _loader():
    tokens = torch.randint(0, 50, (48, 33), generator=torch.Generator().manual_seed(0))
    target = tokens[:, 1:].clone()
    target[:, :3] = -100  # as many masked on every row: 1F1B's weighting by samples is the tokens' here
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], target), batch_size=16)


def _train(model: nn.Module, batches, inside: bool) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches:
        opt.zero_grad()
        (model(x, target=y) if inside else _loss_fn(model(x), y)).backward()
        opt.step()
    return model


@w.float64
def _planned(pins: dict):
    reference = w.state(_train(w.seeded(_TinyLM, 0), _loader(), False))
    plan = autodist.plan(w.seeded(_TinyLM, 0), _loader(), loss_fn=_loss_fn, **pins)
    gpipe = autodist.plan(w.seeded(_TinyLM, 0), _loader(), autodist.Auto(finalists=0), **pins)
    model, loader = autodist.parallelize(w.seeded(_TinyLM, 0 if w.rank() == 0 else 3), _loader(), plan=plan,
                                         loss_fn=_loss_fn)
    trained = dict(autodist.gather_state_dict(_train(model, loader, True), all_ranks=True))
    refused = ""
    if plan.layout.pp > 1:
        with pytest.raises(ValueError) as err:
            autodist.parallelize(w.seeded(_TinyLM, 0), _loader(), plan=plan)
        refused = str(err.value)
    return plan.to_json(), gpipe.to_json(), reference, trained, refused


@pytest.mark.slow
@pytest.mark.parametrize("pins", [pytest.param({"pp": 2}, id="pp2"), pytest.param({}, id="free")])
def test_a_plan_for_the_loss_inside_the_forward_pipelines_1f1b_and_trains_as_one_process(ranks, pins):
    for text, gpipe_text, reference, trained, refused in ranks(2, _planned, pins):
        plan, gpipe = autodist.ParallelPlan.from_json(text), autodist.ParallelPlan.from_json(gpipe_text)
        assert plan.schedule == "1F1B" and gpipe.schedule == "" and "1F1B" in str(plan)
        assert_close(trained, reference, rtol=0, atol=1e-10)
        staged = {r.label: r for r in gpipe.rows if r.layout.pp > 1 and not r.impossible}
        one_f_one_b = [r for r in plan.rows if r.layout.pp > 1 and not r.impossible]
        assert one_f_one_b
        for r in one_f_one_b:  # pp - s of m micro-batches in flight: a stage holds less, the more micro-batches
            assert r.memory["activations"] < 0.75 * staged[r.label].memory["activations"], r.label
        if plan.layout.pp > 1:
            assert "planned with loss_fn=" in refused and "1F1B" in refused
        assert not any(r.status.startswith("not possible: could not be made") for r in plan.rows), str(plan)
