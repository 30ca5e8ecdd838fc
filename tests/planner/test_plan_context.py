"""plan="auto" searches context parallelism where asked (``Auto(cp=True)``, or ``cp=K`` pinned): a model whose forward
makes attention calls gets ``cp`` candidates (their exchange read from the calls, their activations a ``1/cp`` share
plus the gathered keys and values), a model without them and data that cp cannot cut a reason on each ``cp`` row;
a plan that chooses ``cp`` trains as one process (nanoGPT, float64, against one process at the float floor)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
import workloads as w
from autodist.cp import explain as cp_explain
from autodist.planner.context import contexts
from outside.nanogpt import GPT, GPTConfig

LENGTH, ROWS = 13, 3  # 13 tokens: no rank's share is as long as the rows (cp's ambiguous-arange refusal)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(LENGTH)
    x, y = (torch.randint(0, 32, (ROWS * 4, LENGTH), generator=g) for _ in range(2))
    y[:, :3] = -1  # masked labels: a token mean over the valid ones
    return DataLoader(TensorDataset(x, y), batch_size=ROWS)


def _train(model: nn.Module, loader) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in loader:
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return model


def test_the_exchange_and_the_kept_keys_are_read_from_the_attention_calls():
    x, y = next(iter(_loader()))
    found = contexts(_gpt(), (x, y), ROWS, [2, 3], loader=True, batch_dim=0)
    for k in (2, 3):
        plan = cp_explain.explain(_gpt(), k, (x, y))
        forward, backward = plan.sent()
        assert found[k].impossible == "" and found[k].calls == 2 == len(plan.calls)
        assert found[k].sent_per_row == (forward + backward) / ROWS > 0
        whole = 2 * 2 * LENGTH * 8 * 2 * 4  # 2 calls x 2 heads x 13 tokens x (8 + 8 wide) x 4 bytes, per row
        assert found[k].kept_per_row == (0 if plan.calls[0].again else whole)
    plain = contexts(w.mlp(), (torch.randn(ROWS, 6),), ROWS, [2], loader=True, batch_dim=0)
    assert "no attention call" in plain[2].impossible  # asked for, on a model with nothing to split: said
    assert "batch_dim=1" in contexts(_gpt(), (x, y), ROWS, [2], loader=True, batch_dim=1)[2].impossible
    assert "DataLoader" in contexts(_gpt(), (x, y), ROWS, [2], loader=False, batch_dim=0)[2].impossible
    short = (x[:, :3].contiguous(), y[:, :3].contiguous())  # 3 tokens: fewer than cp=2's 4 chunks
    assert "chunks" in contexts(_gpt(), short, ROWS, [2], loader=True, batch_dim=0)[2].impossible


@w.float64
def _planned_with_cp(pins: dict) -> tuple[str, float]:
    plan = autodist.plan(_gpt(), _loader(), autodist.Auto(steps=2), **pins)
    model, loader = autodist.parallelize(_gpt(), _loader(), plan=plan)
    trained = autodist.gather_state_dict(_train(model, loader), all_ranks=True)
    reference = _train(_gpt(), _loader()).state_dict()
    return plan.to_json(), max(float((trained[k] - v).abs().max()) for k, v in reference.items())


def test_a_plan_that_chooses_cp_trains_as_one_process(ranks):
    for text, worst in ranks(2, _planned_with_cp, {"cp": 2}):
        plan = autodist.ParallelPlan.from_json(text)
        print(plan)
        assert plan.layout.cp == 2 and {r.layout.cp for r in plan.rows} == {2}
        assert worst <= 1e-10, worst
        # its peaks: tests/planner/test_plan.py's nanoGPT (here a third of a MB, the sync's page-rounded slots)


def _free(data: str, cp: bool = True) -> str:
    loader = _loader()
    given = loader if data == "loader" else next(iter(loader))
    return autodist.plan(_gpt(), given, autodist.Auto(steps=2, batch_size=ROWS, finalists=0, cp=cp)).to_json()


def test_cp_is_searched_when_asked_for_a_model_with_attention_and_named_where_the_data_cannot_be_cut(ranks):
    plan = autodist.ParallelPlan.from_json(ranks(2, _free, "loader", False)[0])
    assert {r.layout.cp for r in plan.rows} == {1}  # not asked: a loss slicing the sequence would be wrong under cp
    plan = autodist.ParallelPlan.from_json(ranks(2, _free, "loader")[0])
    cp = [r for r in plan.rows if r.layout.cp == 2]
    assert cp and all(r.fits and r.seconds for r in cp)
    assert "cp" in str(plan).splitlines()[1].split()  # the table has a cp column
    plan = autodist.ParallelPlan.from_json(ranks(2, _free, "tensors")[0])
    cp = [r for r in plan.rows if r.layout.cp == 2]
    assert cp and all("DataLoader" in r.impossible for r in cp)


def _gpt_four() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=4, n_head=4, n_embd=64, dropout=0.0))


def _tokens() -> DataLoader:
    tokens = torch.randint(0, 96, (24, 33), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


@w.float64
def _staged_and_split() -> tuple[str, float]:
    plan = autodist.plan(_gpt_four(), _tokens(), autodist.Auto(cp=True, finalists=3), cp=2, pp=2)
    model, loader = autodist.parallelize(_gpt_four(), _tokens(), plan=plan)
    trained = autodist.gather_state_dict(_train(model, loader), all_ranks=True)
    reference = _train(_gpt_four(), _tokens()).state_dict()
    return plan.to_json(), max(float((trained[k] - v).abs().max()) for k, v in reference.items())


@pytest.mark.slow
def test_cp_with_pp_is_planned_within_10_percent_and_trains_as_one_process(ranks):
    """cp=2 x pp=2 on 4 ranks (nanoGPT, two blocks a stage): each stage's memory as pp predicts it at 1/cp of the
    tokens, plus its share of the attention calls' gathered keys and values."""
    for text, worst in ranks(4, _staged_and_split):
        plan = autodist.ParallelPlan.from_json(text)
        measured = [r for r in plan.rows if r.measured_peak]
        assert measured and all(r.layout.cp == 2 and r.layout.pp == 2 for r in plan.rows), str(plan)
        for r in measured:
            assert abs(r.peak / r.measured_peak - 1) <= 0.10, (r.label, r.peak, r.measured_peak)
        assert worst <= 1e-10, worst
