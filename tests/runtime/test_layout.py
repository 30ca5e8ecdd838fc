"""``autodist.Layout``: the object a plan chooses, written by hand. ``parallelize(model, loader, layout=...)`` is the
same training as the keywords it stands for (float64, one process the reference); a keyword beside it that
disagrees, a ``dp`` that does not make the world, and bad values are named; a plan saved before the layout had
``pp``, ``cp``, ``precision`` and ``ep`` still loads."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.runtime.layout import Layout


def test_a_layout_fills_its_data_parallel_ranks_from_the_world():
    layout = autodist.Layout(mp=2, shard="parameters", precision=torch.bfloat16)
    assert layout.for_world(8) == Layout(dp=4, mp=2, shard="parameters", precision="bf16")
    assert str(layout.for_world(8)) == "dp=4 x mp=2, shard='parameters', precision='bf16'"
    assert str(Layout(dp=1, cp=2, pp=2, checkpoint=True)) == "dp=1 x cp=2 x pp=2 x mp=1, shard=None, checkpoint=True"
    assert layout.options() == {"mp": 2, "pp": 1, "cp": 1, "shard": "parameters", "checkpoint": False,
                                "mixed_precision": "bf16", "ep": 1}
    assert str(Layout(ep=2).for_world(4)) == "dp=4 x mp=1, shard=None, ep=2"
    assert Layout.of(None, {"ep": 2}) == Layout(ep=2) and Layout(ep=2).written() == "Layout(ep=2)"
    assert Layout.of(None, {"mp": 2, "mixed_precision": "bfloat16"}) == Layout(mp=2, precision="bf16")
    assert Layout.of(layout, {"mp": 2, "shard": None}) is layout  # a keyword at its default says nothing


@pytest.mark.parametrize("call, words", [
    (lambda: Layout(mp=0), "Layout's mp must be a positive int, got 0"),
    (lambda: Layout(dp=True), "Layout's dp must be a positive int or None"),
    (lambda: Layout(shard="all"), "Layout's shard must be one of"),
    (lambda: Layout(checkpoint="yes"), "Layout's checkpoint must be True or False"),
    (lambda: Layout(precision="fp8"), r"mixed_precision \(a Layout's precision\) must be 'bf16', 'fp16'"),
    (lambda: Layout(mp=2).for_world(3), "does not make the world's 3 ranks: launch a multiple of 2 ranks"),
    (lambda: Layout(dp=2, pp=2).for_world(8), "does not make the world's 8 ranks: launch 4 ranks"),
    (lambda: Layout(ep=3).for_world(4), r"ep=3 does not divide its dp=4 data-parallel ranks .* \[1, 2, 4\]"),
    (lambda: Layout(ep=0), "Layout's ep must be a positive int, got 0"),
    (lambda: Layout.of(Layout(mp=2), {"mp": 4}), r"mp=4 given beside layout=Layout\(mp=2\), which says mp=2"),
    (lambda: Layout.of({"mp": 2}, {}), "layout must be an autodist.Layout, got dict"),
])
def test_bad_layouts_are_named(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()


def test_a_plan_saved_before_the_layout_grew_still_loads(tmp_path):
    layout = {"dp": 2, "mp": 1, "shard": "optimizer", "checkpoint": False}  # the format's first layouts
    saved = {"format": 1, "world_size": 2, "budget": 1e9, "optimizer_states": 2, "batch_size": 8, "layout": layout,
             "rows": [{"layout": layout, "status": "chosen"}], "reason": "", "search_seconds": 1.0}
    (tmp_path / "plan.json").write_text(json.dumps(saved))
    plan = autodist.ParallelPlan.load(tmp_path / "plan.json")
    assert plan.layout == Layout(dp=2, shard="optimizer") and plan.layout.pp == plan.layout.cp == 1
    assert autodist.ParallelPlan.from_json(plan.to_json()) == plan


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _train(model: nn.Module, batches) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return autodist.gather_state_dict(model, all_ranks=True) if autodist.world_size() > 1 else w.state(model)


@w.float64
def _by_layout(layout: Layout):
    x, y = w.digits_like(24)
    reference = _train(w.seeded(_Net, 0), w.loader(x, y, 8, shuffle=False))
    model, loader = autodist.parallelize(w.seeded(_Net, 0 if w.rank() == 0 else 5), w.loader(x, y, 8, shuffle=False),
                                         layout=layout)
    return reference, _train(model, loader), dict(autodist.memory(model)), model.__class__.__name__


@pytest.mark.parametrize("layout", [Layout(dp=2, shard="parameters", checkpoint=True), Layout(mp=2),
                                    pytest.param(Layout(pp=2), marks=pytest.mark.slow)], ids=str)
def test_a_layout_trains_as_the_keywords_it_stands_for(ranks, layout):
    for reference, trained, held, _ in ranks(2, _by_layout, layout):
        assert_close(trained, reference, rtol=0, atol=1e-10)
        # what it says was made: each layout here leaves a rank about half the parameters
        whole = sum(v.numel() * v.element_size() for v in reference.values())
        assert held["parameters"] < 0.6 * whole, (held, whole)


def _refused(layout: Layout, keywords: dict):
    try:
        autodist.parallelize(_Net(), None, layout=layout, **keywords)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_layout_that_does_not_make_the_world_or_disagrees_is_named(ranks):
    said = ranks(2, _refused, Layout(dp=4), {})
    assert all("the layout dp=4 x cp=1 x pp=1 x mp=1 does not make the world's 2 ranks: launch 4 ranks" in s
               for s in said), said
    said = ranks(2, _refused, Layout(mp=2), {"shard": "optimizer"})
    assert all("shard='optimizer' given beside layout=Layout(mp=2), which says shard=None" in s for s in said), said
    said = ranks(2, _refused, Layout(mp=2), {"plan": "auto"})
    assert all("plan= and layout= were both given" in s for s in said), said
