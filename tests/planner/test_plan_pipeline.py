"""plan="auto" searches pipeline stages too: every ``dp x pp x mp`` factorization of the world is a candidate, a
stage's memory predicted from the cut the pipeline makes (tests/planner/test_plan.py's nanoGPT finalists include
``pp=2``: within 10% there), and a layout with stages chosen trains as one process (float64, 4 ranks)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import autodist
import fresh
import workloads as w


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Net(nn.Module):
    def __init__(self, around: bool = False, flat: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(6, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.around = around  # a residual around the blocks: no pipeline stage after the first can run it
        self.flat = flat  # one row of the output per batch, not per sample: the micro-batches' cannot be merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = first = self.blocks[0](self.embed(x))
        for block in self.blocks[1:]:
            h = block(h)
        out = self.head(h + first if self.around else h)
        return out.reshape(1, -1) if self.flat else out


def _train(model: nn.Module, batches) -> dict:
    return w.state(w.train(model, batches, "adam", 1))


@w.float64
def _planned(pins: dict):
    x, y = w.digits_like(48)
    reference = _train(w.seeded(_Net, 0), w.loader(x, y, 16, shuffle=False))
    plan = autodist.plan(w.seeded(_Net, 0), w.loader(x, y, 16, shuffle=False), **pins)
    model, loader = autodist.parallelize(w.seeded(_Net, 0 if w.rank() == 0 else 3), w.loader(x, y, 16, shuffle=False),
                                         plan=plan)
    trained = _train(model, loader)
    if any(hasattr(m, "dense_state") for m in model.modules()):
        trained = dict(autodist.gather_state_dict(model, all_ranks=True))
    return plan.to_json(), reference, trained


def _launched(out: str) -> None:
    """This file's script part (fresh.py): each rank writes the plan and its training's largest difference from
    one process."""
    autodist.init()
    text, reference, trained = _planned({"pp": 2})
    worst = max(float((trained[k] - reference[k]).abs().max()) for k in reference)
    fresh.write(out, autodist.rank(), {"plan": text, "worst": worst, "keys": sorted(trained) == sorted(reference)})


@pytest.mark.slow
def test_every_factorization_is_a_candidate_and_a_pipeline_chosen_trains_as_one_process(tmp_path):
    results = fresh.launched(os.path.abspath(__file__), 4, tmp_path / "result")  # not the pools: see fresh.py
    plan = autodist.ParallelPlan.from_json(results[0]["plan"])
    print(plan)
    assert {(r.layout.dp, r.layout.pp, r.layout.mp) for r in plan.rows} == {(2, 2, 1), (1, 2, 2)}  # pp kept
    assert plan.layout.pp == 2 and [r.status for r in plan.rows].count("chosen") == 1
    measured = [r for r in plan.rows if r.measured_peak]
    assert measured and all(abs(r.peak / r.measured_peak - 1) <= 0.10 for r in measured), \
        [(str(r.layout), r.peak, r.measured_peak) for r in measured]
    for result in results:
        assert result["keys"] and result["worst"] <= 1e-10, result["worst"]


def _candidates():
    x, y = w.digits_like(48)
    return autodist.plan(w.seeded(_Net, 0), w.loader(x, y, 16, shuffle=False), autodist.Auto(finalists=0)).to_json()


@pytest.mark.slow
def test_four_ranks_search_every_dp_pp_mp_factorization(ranks):
    plan = autodist.ParallelPlan.from_json(ranks(4, _candidates)[0])
    made = {(r.layout.dp, r.layout.pp, r.layout.mp) for r in plan.rows}
    assert made == {(4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)}, made
    four = [r for r in plan.rows if r.layout.pp == 4 and r.layout.shard is None]
    assert four and all(not r.impossible and r.peak > 0 for r in four)  # 4 blocks: 4 stages of one


def _refused(options: dict):
    x, y = w.digits_like(48)
    plan = autodist.plan(w.seeded(lambda: _Net(**options), 0), w.loader(x, y, 16, shuffle=False),
                         autodist.Auto(finalists=4))
    return plan.to_json()


@pytest.mark.parametrize("options, words", [
    ({"around": True}, "stage 1: add on the output of blocks.0"),
    ({"flat": True}, "the last stage: output of the model's forward is a tensor of shape (1, "),
], ids=["residual-around-blocks", "output-not-per-sample"])
def test_a_cut_no_stage_can_run_is_not_a_candidate_and_no_trial_waits_on_it(ranks, options, words):
    """A trial of a cut that one stage cannot run would leave the other stage waiting on its sends: each cut is
    run here first, stage by stage, and the micro-batches' outputs merged as the last stage merges them; one
    that raises is named in the table."""
    plan = autodist.ParallelPlan.from_json(ranks(2, _refused, options)[0])
    staged = [r for r in plan.rows if r.layout.pp == 2]
    said = "pp=2 cannot run the model (cut as the pipeline cuts it): " + words
    assert staged and all(r.impossible.startswith(said) for r in staged), [r.impossible for r in staged]
    assert plan.layout.pp == 1


if __name__ == "__main__":
    _launched(sys.argv[1])


def _micro_batches(pins: dict):
    x, y = w.digits_like(48)
    return autodist.plan(w.seeded(_Net, 0), w.loader(x, y, 16, shuffle=False), autodist.Auto(finalists=0),
                         **pins).to_json()


@pytest.mark.parametrize("pins, counts", [({"pp": 2}, {4, 8}), ({"pp": 2, "microbatches": 3}, {3})])
def test_the_micro_batches_a_step_are_searched(ranks, pins, counts):
    """Each pipeline layout once per count of micro-batches (2 x pp, 4 x pp), each modelled with its own
    bubble and sends; the count chosen is what parallelize runs (``plan.options()``); a count the user gives is
    kept."""
    plan = autodist.ParallelPlan.from_json(ranks(2, _micro_batches, pins)[0])
    staged = [r for r in plan.rows if r.layout.pp == 2 and not r.impossible]
    assert {r.microbatches for r in staged} == counts, [(str(r.layout), r.microbatches) for r in staged]
    same = [r for r in staged if r.layout.shard is None and not r.layout.checkpoint]
    assert len({r.seconds for r in same}) == len(counts), [(r.microbatches, r.seconds) for r in same]
    chosen = next(r for r in plan.rows if r.status == "chosen")
    assert plan.options()["microbatches"] == chosen.microbatches and "x" in str(plan)
