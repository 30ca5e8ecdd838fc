"""Planning costs no more than a rank's share: a model whose activations at a rank's rows do not fit the budget is
measured on fewer rows (the most that one row's peak bounds to fit), its layouts extrapolated from them, the
plan's own measuring stays within the budget beside the model, and the extrapolated peaks stay within 10% of
those predicted from the full rows and of the finalists' measured ones (nanoGPT, 2 ranks)."""
from __future__ import annotations

import pytest
import torch

import autodist
import workloads as w
from autodist.planner import search as search_mod
from autodist.planner.live import LiveBytes
from outside.nanogpt import GPT, GPTConfig

_BUDGET_GB = 0.012  # replicated needs 16.6 MB at 16 rows a rank, checkpointed 8.7 MB; 32 rows' pass makes 28 MB


def _gpt():
    config = GPTConfig(block_size=64, vocab_size=96, n_layer=3, n_head=4, n_embd=64, dropout=0.0)
    return GPT(config)


def _loader():
    tokens = torch.randint(0, 96, (64, 64), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=32)


def _planned(budget_gb: float | None, finalists: int):
    """The plan, the rows the profile measured at, and the most bytes the planning made at one time."""
    measured_at = []
    measure = search_mod.measure

    def spy(model, example, rows, *args, **kwargs):
        measured_at.append(rows)
        return measure(model, example, rows, *args, **kwargs)

    search_mod.measure = spy
    try:
        model = w.seeded(_gpt, 0)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        with LiveBytes() as live:
            plan = autodist.plan(model, _loader(), autodist.Auto(budget_gb=budget_gb, finalists=finalists))
    finally:
        search_mod.measure = measure
    return plan.to_json(), measured_at, live.peak, held


def _plans():
    return _planned(_BUDGET_GB, 0), _planned(None, 0), _planned(_BUDGET_GB, 4)


@pytest.mark.slow
def test_a_model_whose_share_does_not_fit_is_planned_within_the_budget(ranks):
    for (tight, free, measured) in ranks(2, _plans):
        plan, rows, peak, held = tight
        assert rows[0][1] < 32, rows  # fewer rows than twice a rank's share of 32
        assert peak <= _BUDGET_GB * 1e9 - held, (peak, held)  # the planning's measuring, beside the model
        by_layout = {str(r.layout): r for r in autodist.ParallelPlan.from_json(plan).rows if r.layout.pp == 1}
        full = autodist.ParallelPlan.from_json(free[0])
        assert free[1][0] == (16, 32) and free[2] > _BUDGET_GB * 1e9  # unbounded, it measures (and makes) more
        compared = [r for r in full.rows if not r.impossible and r.layout.pp == 1]  # a cut may fall elsewhere
        for r in compared:
            other = by_layout[str(r.layout)]
            assert abs(other.peak / r.peak - 1) <= 0.10, (str(r.layout), other.peak, r.peak)
        assert len(compared) >= 6
        chosen = autodist.ParallelPlan.from_json(measured[0])
        finalists = [r for r in chosen.rows if r.measured_peak]
        assert len(finalists) >= 3 and all(r.layout.checkpoint for r in finalists)
        for r in finalists:
            assert abs(r.peak / r.measured_peak - 1) <= 0.10, (str(r.layout), r.peak, r.measured_peak)
        assert next(r for r in chosen.rows if r.status == "chosen").measured_peak <= _BUDGET_GB * 1e9


def test_the_rows_measured_double_while_the_line_through_the_last_two_fits():
    from autodist.planner.profile import rows_within

    seen = []

    def line(r: int) -> float:
        seen.append(r)
        return 5e8 + 5e7 * r

    assert rows_within(line, (16, 32), room=1.5e9, name="GPT") == (4, 8) and seen == [1, 2, 4, 8]
    assert rows_within(line, (16, 32), room=1e12, name="GPT") == (16, 32)  # it fits: the share, as always
    batch_norm = rows_within(lambda r: float("nan") if r == 1 else 1e6 * r, (16, 32), room=1e7, name="BN")
    assert batch_norm == (3, 6)  # one row fails: two and three first
    assert rows_within(lambda r: 1e9, (16, 32), room=1e7, name="GPT") == (1, 2)  # the least it measures
    with pytest.raises(ValueError, match="2 rows of the batch ran out of the device's memory"):
        rows_within(lambda r: float("inf") if r > 1 else 1.0, (16, 32), room=1e7, name="GPT")
