"""``parallelize(..., mixed_precision="bf16")``: float32 master weights, computed in bfloat16, equal to one process
with the same option at the split floor.

The reference is written without autodist: ``torch.func.functional_call`` with every parameter cast to bfloat16
(each parameter is used once per forward in these models, as each module's cast uses it), the input cast too;
each slice of the global batch as a rank holds it, its float32 gradient weighted by its share and summed.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.dp.data import slice_bounds

EXACT = [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}, {"checkpoint": True},
         {"shard": "gradients", "checkpoint": True}, {"shard": "parameters", "checkpoint": True}]


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), *[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())
                                            for _ in range(3)], nn.Linear(8, 3))


def _cast_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The option's meaning, written out: every parameter and the input in bfloat16."""
    casts = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    return functional_call(model, casts, (x.to(torch.bfloat16),))


def _split_floor(ranks: int, drop: frozenset = frozenset()) -> dict:
    """``drop``: names of parameters whose gradient is dropped (a broken reference, to show a test can tell)."""
    x, y = w.digits_like(22)
    model = w.seeded(_build, 0)
    params = list(model.parameters())
    kept = [name not in drop for name, _ in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for bx, by in w.loader(x, y, 8, shuffle=False):
        total = [torch.zeros_like(p) for p in params]
        for r in range(ranks):
            part = slice(*slice_bounds(len(bx), r, ranks))
            rows, labels = bx[part].clone(), by[part].clone()  # fresh, as the rank's DataLoader collates them
            loss = F.cross_entropy(_cast_forward(model, rows).float(), labels)
            for t, g in zip(total, torch.autograd.grad(loss, params)):
                t.add_(g.mul_((part.stop - part.start) / len(bx)))
        for p, t, keep in zip(params, total, kept):
            p.grad = t if keep else torch.zeros_like(t)
        opt.step()
    return w.state(model)


def _run(layout: dict) -> tuple[dict, dict, set]:
    x, y = w.digits_like(22)
    model, data = autodist.parallelize(w.seeded(_build, 100 * w.rank()), w.loader(x, y, 8, shuffle=False),
                                       mixed_precision="bf16", **layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dtypes = set()
    for bx, by in data:
        opt.zero_grad()
        out = model(bx)
        F.cross_entropy(out.float(), by).backward()
        dtypes |= {out.dtype, *(p.grad.dtype for p in model.parameters())}
        opt.step()
    return _split_floor(2), autodist.gather_state_dict(model, all_ranks=True), dtypes


@pytest.mark.parametrize("layout", EXACT, ids=str)
def test_mixed_precision_trains_as_one_process_with_the_option_at_the_split_floor(ranks, layout):
    for floor, state, dtypes in ranks(2, _run, layout):
        assert dtypes == {torch.bfloat16, torch.float32}  # bfloat16 output, float32 gradients
        assert all(v.dtype == torch.float32 for v in state.values())  # the master, as a checkpoint holds it
        assert_close(state, floor, rtol=0, atol=0)


@pytest.mark.parametrize("layout", [{"mp": 2}, {"pp": 2}], ids=str)
def test_mixed_precision_with_split_layers_and_stages_stays_near_the_split_floor(ranks, layout):
    # mp splits each product (its sums round in bfloat16 in other places), pp sums micro-batches' gradients:
    # near the floor, not bit for bit: each tensor's update (trained minus initial) within 5% of the floor's
    # (L2; 1% here), where an untrained tensor is 1 off
    initial = w.state(w.seeded(_build, 0))
    broken = _split_floor(2, drop=frozenset(w.norm_parameters(_build())))
    for floor, state, dtypes in ranks(2, _run, layout):
        assert dtypes == {torch.bfloat16, torch.float32}
        error = w.update_error(state, floor, initial)
        assert max(error.values()) <= 0.05, sorted(error.items(), key=lambda kv: -kv[1])[:3]  # 1% here
    dropped = w.update_error(broken, floor, initial)  # the bound can tell a norm left untrained
    assert all(dropped[name] > 0.05 for name in w.norm_parameters(_build())), dropped


def test_in_one_process_the_option_is_its_meaning():
    model = w.seeded(_build, 0)
    reference = copy.deepcopy(model)
    model, _ = autodist.parallelize(model, mixed_precision=torch.bfloat16)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    out = model(x)
    assert out.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in model.parameters())
    assert_close(out, _cast_forward(reference, x), rtol=0, atol=0)
    out.float().sum().backward()
    _cast_forward(reference, x).float().sum().backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()], rtol=0, atol=0)
    for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # an ordinary module, hooks and all
        assert_close(again(x), out, rtol=0, atol=0)


def _refused(option, model_dtype, layout) -> str:
    try:
        autodist.parallelize(_build().to(model_dtype), mixed_precision=option, **layout)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return "not refused"


@pytest.mark.parametrize("option, model_dtype, layout, words", [
    ("bf32", torch.float32, {}, "must be 'bf16', 'fp16'"),
    ("bf16", torch.bfloat16, {}, "drop mixed_precision"),
], ids=["unknown", "already-low"])
def test_what_the_option_cannot_do_it_says(ranks, option, model_dtype, layout, words):
    for message in ranks(2, _refused, option, model_dtype, layout):
        assert words in message, message


def _gathered_dtypes() -> tuple[set, set]:
    from autodist.sharded.parameters import sharding_of

    x, y = w.digits_like(22)
    model, data = autodist.parallelize(w.seeded(_build, 0), w.loader(x, y, 8, shuffle=False),
                                       mixed_precision="bf16", shard="parameters")
    sharding = sharding_of(model)
    seen: set = set()
    model[2].register_forward_hook(lambda *_: seen.update(b.full.dtype for b in sharding.blocks
                                                           if b.full is not None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for bx, by in data:
        F.cross_entropy(model(bx).float(), by).backward()
        opt.step()
        opt.zero_grad()
    return seen, {part.shard.dtype for b in sharding.blocks for part in b.parts}


def test_shard_parameters_gathers_in_the_compute_dtype(ranks):
    for gathered, master in ranks(2, _gathered_dtypes):
        assert gathered == {torch.bfloat16}  # half the bytes of float32 on the wire and in memory
        assert master == {torch.float32}  # what each rank keeps and steps


def _summary() -> list[str]:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        autodist.parallelize(_build(), mixed_precision="bf16")
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return [r.getMessage() for r in records if r.getMessage().startswith("parallelized")]


def test_the_summary_line_names_the_option(ranks):
    summary, nothing = ranks(2, _summary)
    assert len(summary) == 1 and "mixed_precision='bf16' (float32 master weights)" in summary[0], summary
    assert nothing == []  # rank 0 alone says it


class _SharedTwice(nn.Module):
    """One block run twice in each forward (shared layers, as ALBERT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.shared, self.head = nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(self.embed(x))))


def _a_block_run_twice(layout: dict) -> str:
    named = {"blocks": ["shared"]} if layout.get("shard") == "parameters" or layout.get("checkpoint") else {}
    model, (x, y) = autodist.parallelize(w.seeded(_SharedTwice, 0), w.digits_like(n=8), mixed_precision="bf16",
                                         **named, **layout)
    try:
        for _ in range(2):
            F.cross_entropy(model(x).float(), y).backward()
    except RuntimeError as error:
        return str(error)
    return "trained"


@pytest.mark.parametrize("layout, said", [
    ({"shard": "parameters"}, "block 'shared' ran twice in one forward"),
    ({"shard": "parameters", "checkpoint": True}, "block 'shared' ran twice in one forward"),
    ({"shard": "gradients"}, "trained"), ({"checkpoint": True}, "trained")], ids=str)
def test_a_block_run_twice_under_shard_parameters_is_refused_by_name(ranks, layout, said):
    """Under mixed_precision each call would gather the block anew in bfloat16, its parameters getting a second
    gradient accumulator: refused where the second call begins, naming the block and what works (before: a
    wrong hint about reentrant checkpointing in backward). A checkpointed block's recompute is no second call."""
    for got in ranks(2, _a_block_run_twice, layout):
        assert said in got, got
