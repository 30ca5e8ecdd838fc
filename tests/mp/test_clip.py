"""Clipping under ``mp=K``: ``clip_grad_norm_`` and ``get_total_norm`` give every rank the whole model's norm.

Each rank holds its shards of the split layers; the norm torch takes of their gradients alone is the shard's
(0.301 and 0.330 on the two ranks of an MLP whose norm is 0.4275 in one process), so each rank clipped by its
own factor and the parameters held whole drifted apart. These tests train with clipping that bites and
compare with one process: the norm returned on every rank, the parameters, and the replicated parameters
identical on the ranks of a group. A loop that does not clip sends nothing more.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
from autodist.dp import grad_sync
from autodist.layers.split_grad import SplitGrad, split_group
from collectives import counted
from outside.nanogpt import GPT, GPTConfig

GPT_CONFIG = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=True)


def _mlp() -> nn.Module:
    # two Megatron pairs around a LayerNorm: split weights, and replicated row biases and LayerNorm
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.LayerNorm(16),
                         nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))


def _gpt() -> nn.Module:
    return GPT(GPT_CONFIG)


def _batch(model_name: str, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model_name == "gpt":
        x = torch.randint(0, GPT_CONFIG.vocab_size, (rows, 12), generator=g)
        return x, torch.roll(x, -1, 1)
    return torch.randn(rows, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=g)


def _loss(model_name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1] if model_name == "gpt" else F.cross_entropy(model(x), y)


def _seeded(model_name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return (_gpt() if model_name == "gpt" else _mlp()).double()


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model_name: str, opt_name: str, norm_type: float, foreach: bool | None, mp: int = 2,
           shard: str | None = None, views: bool = False, steps: int = 3, max_norm: float = 0.05):
    """The clipped training in parallel and in one process: per step the norms, then the states, and the
    replicated parameters of every rank of this rank's model-parallel group. ``views``: the averaged gradients
    become views of the buckets, as a large model's do (a small one's are copied back)."""
    small = grad_sync.COPY_BACK_BELOW_BYTES
    grad_sync.COPY_BACK_BELOW_BYTES = 0 if views else small
    try:
        return _train_clipped(model_name, opt_name, norm_type, foreach, mp, shard, steps, max_norm)
    finally:
        grad_sync.COPY_BACK_BELOW_BYTES = small


def _train_clipped(model_name: str, opt_name: str, norm_type: float, foreach: bool | None, mp: int,
                   shard: str | None, steps: int, max_norm: float):
    x, y = _batch(model_name)
    ref = _seeded(model_name, 0)
    rank = dist.get_rank()
    model, (xs, ys) = autodist.parallelize(_seeded(model_name, 0 if rank == 0 else 9), (x, y), mp=mp, shard=shard,
                                           example=(x[:2],))
    norms = []
    for m, xb, yb in ((model, xs, ys), (ref, x, y)):
        optimizer, got = _optimizer(opt_name, m), []
        for _ in range(steps):
            optimizer.zero_grad()
            _loss(model_name, m, xb, yb).backward()
            got.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type=norm_type,
                                                      error_if_nonfinite=True, foreach=foreach))
            optimizer.step()
        norms.append(torch.stack(got))
    with autodist.full_parameters(model) if shard == "parameters" else contextlib.nullcontext():
        whole = torch.cat([p.detach().reshape(-1) for p in model.parameters() if split_group(p) is None])
    every = [torch.empty_like(whole) for _ in range(dist.get_world_size())]
    dist.all_gather(every, whole)
    return {"norms": norms, "state": (autodist.gather_state_dict(model, all_ranks=True), ref.state_dict()),
            "whole": [every[r] for r in range(len(every)) if r // mp == rank // mp],
            "ref_norms_clip": bool((norms[1] > max_norm).all())}


def _assert_trained_as_one_process(results) -> None:
    for out in results:
        assert out["ref_norms_clip"], "max_norm must be small enough to clip at every step"
        got, expected = out["norms"]
        assert_close(got, expected, rtol=1e-9, atol=1e-12)      # the same norm on every rank, as one process's
        state, reference = out["state"]
        assert state.keys() == reference.keys()
        for name in reference:
            assert_close(state[name], reference[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        for other in out["whole"][1:]:
            assert torch.equal(other, out["whole"][0])              # the replicated parameters never drift apart


@pytest.mark.parametrize("model_name,opt_name", [("mlp", "sgd"), ("mlp", "adamw"), ("gpt", "adamw")])
def test_mp2_clipped_training_is_one_process(ranks, model_name, opt_name):
    _assert_trained_as_one_process(ranks(2, _train, model_name, opt_name, 2.0, None))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("foreach", [True, False])
def test_mp2_norm_types_and_foreach(ranks, norm_type, foreach):
    _assert_trained_as_one_process(ranks(2, _train, "mlp", "sgd", norm_type, foreach))


@pytest.mark.parametrize("shard,views", [(None, False), (None, True), ("gradients", False), ("parameters", False)])
def test_dp2_mp2_clipped_training_is_one_process(ranks, shard, views):
    _assert_trained_as_one_process(ranks(4, _train, "gpt", "adamw", 2.0, None, 2, shard, views))


def _total_norms():
    """get_total_norm of the gradients, and what the split gradients are to the rest of the loop."""
    x, y = _batch("mlp")
    ref = _seeded("mlp", 0)
    model, _ = autodist.parallelize(_seeded("mlp", 0), (x, y), mp=2, example=(x[:2],))
    for m in (model, ref):
        _loss("mlp", m, x, y).backward()
    grads = [p.grad for p in model.parameters()]
    split = [g for g in grads if isinstance(g, SplitGrad)]
    plain = torch.nn.utils.get_total_norm([g.as_subclass(torch.Tensor) for g in grads])  # the shards' own norm
    everyday = [type(split[0].sum()), type(split[0] * 2), type(split[0].clone()), type(split[0].norm().item())]
    return (torch.nn.utils.get_total_norm(grads), torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]),
            plain, len(split), everyday, split[0].norm().item() == split[0].as_subclass(torch.Tensor).norm().item())


def test_get_total_norm_is_the_whole_models_and_gradients_stay_plain_tensors(ranks):
    results = ranks(2, _total_norms)
    for got, expected, shard_only, n_split, everyday, same_value in results:
        assert_close(got, expected, rtol=1e-9, atol=1e-12)
        assert not torch.allclose(shard_only, expected)   # what every rank got before: its shards' norm
        assert n_split == 6 and same_value                 # 2 pairs: column weight and bias, row weight
        assert everyday == [torch.Tensor, torch.Tensor, torch.Tensor, float]


def _collectives_of_a_step(clip: bool, dp_mp: tuple[int, int]):
    dp, mp = dp_mp
    x, y = _batch("mlp")
    model, (xs, ys) = autodist.parallelize(_seeded("mlp", 0), (x, y), mp=mp, example=(x[:2],))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        _loss("mlp", model, xs, ys).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()

    step()  # the first step makes the buckets
    return counted(step), counted(step), autodist.explain(_seeded("mlp", 0), mp=mp).collectives_per_step


@pytest.mark.parametrize("size,dp_mp", [(2, (1, 2)), (4, (2, 2))])
def test_a_loop_that_does_not_clip_sends_nothing_more(ranks, size, dp_mp):
    plain = ranks(size, _collectives_of_a_step, False, dp_mp)
    clipped = ranks(size, _collectives_of_a_step, True, dp_mp)
    for (first, second, planned), (clip_first, _, _) in zip(plain, clipped):
        assert first == second
        if dp_mp[0] == 1:
            assert len(first) == planned, first                      # the model-parallel layers' own, no more
        assert sorted(clip_first) == sorted(first + ["all_reduce"])   # clipping: one all-reduce of one number
