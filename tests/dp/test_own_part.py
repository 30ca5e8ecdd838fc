"""A rank's own part of each bucket, summed straight from autograd's gradients through shared memory.

The model here holds more than 4 MiB of gradients (a small one is copied back whole, and packed whole), so
after accumulation its buckets take the path: its own part left out of packing and summed in the
gradients themselves. Compared with the single-process run and, bit for bit, with the
same run packing every number (the own part switched off in the ranks).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.dp import exchange, own_part
from autodist.dp.grad_sync import state_of
from autodist.runtime.shared_slots import part
from outside import nanogpt


def _big() -> torch.nn.Module:
    """4.3 MiB of float64 parameters: past the size below which buckets are copied back whole."""
    return torch.nn.Sequential(torch.nn.Linear(6, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 3)).double()


def _steps(model: torch.nn.Module, batches: list, accumulate: bool, no_sync, sync=lambda: None,
           loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])) -> torch.nn.Module:
    """Adam over ``batches``, one step each, or one step per pair with the first under ``no_sync``; ``sync``
    before each step."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    per_step = 2 if accumulate else 1
    for i in range(0, len(batches) - per_step + 1, per_step):
        opt.zero_grad()
        for k, batch in enumerate(batches[i:i + per_step]):
            with no_sync() if k < per_step - 1 else torch.enable_grad():
                loss(model, batch).backward()
        sync()
        opt.step()
    return model


def _run(direct: bool, train, *args) -> tuple[dict, dict, int]:
    """This rank's final parameters and the single-process ones (``train(*args)``), and how many bucket sums
    were made in the gradients."""
    used, plain_own, plain_sum = [0], exchange.SharedSum.own, exchange.sum_from_own

    def counting(*args, **kwargs):
        used[0] += 1
        return plain_sum(*args, **kwargs)

    exchange.sum_from_own = counting
    if not direct:
        exchange.SharedSum.own = lambda self, index: None  # every number packed: the path before
    try:
        return (*train(*args), used[0])
    finally:  # the ranks' processes serve the next test
        exchange.SharedSum.own, exchange.sum_from_own = plain_own, plain_sum


def _train(accumulate: bool, own_data: bool) -> tuple[dict, dict]:
    """``own_data``: the ranks cut each batch themselves (unevenly), so N is counted in the buckets and the
    sync where it changes (the short last batch) multiplies by a correction; accumulating, they sync by hand,
    so that every micro-batch's N is counted at the sync (under no_sync each is counted at once)."""
    x, y = w.digits_like(44)
    x = x.double()
    # five batches of 8, then one of 4: halved on 2 ranks, every micro-batch of a window is split alike
    whole = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 44, 8)]
    ref = _steps(w.seeded(_big, 0), whole, accumulate, torch.enable_grad)
    model = w.seeded(_big, 0 if dist.get_rank() == 0 else 5)
    if own_data:  # and by hand: the sync after accumulation, where N is counted, not known (a correction)
        model, _ = autodist.parallelize(model, sync="manual" if accumulate else "backward")
        me, size = dist.get_rank(), dist.get_world_size()
        cut = [slice(*part(len(bx), me, size)) for bx, _ in whole]
        mine = [(bx[c], by[c]) for (bx, by), c in zip(whole, cut)]
        by_hand = (lambda: autodist.synchronize_model(model)) if accumulate else (lambda: None)
        model = _steps(model, mine, accumulate, torch.enable_grad, by_hand)
    else:
        model, loader = autodist.parallelize(model, w.loader(x, y, 8, shuffle=False))
        model = _steps(model, list(loader), accumulate, lambda: autodist.no_sync(model))
    assert state_of(model).exchange.name == "shared memory"
    return w.state(model), w.state(ref)


@pytest.mark.parametrize("size,own_data", [(2, False), (3, False), (2, True)])
def test_the_own_part_summed_in_the_gradients_gives_the_same_bits(ranks, size, own_data):
    direct = ranks(size, _run, True, _train, True, own_data)
    packed = ranks(size, _run, False, _train, True, own_data)
    for (par, ref, used), (par_packed, _, used_packed) in zip(direct, packed):
        assert used > 0 and used_packed == 0  # the path under test was taken, and not in the run compared
        assert_close(par, ref, rtol=1e-9, atol=1e-10)
        assert_close(par, par_packed, rtol=0, atol=0)
    for par, _, _ in direct[1:]:
        assert_close(par, direct[0][0], rtol=0, atol=0)


def test_a_single_backward_packs_every_number(ranks):
    # Its gradients become views of the slot: the own part would be summed into the slot, which costs more
    # than packing it (see autodist/dp/own_part.py).
    for par, ref, used in ranks(2, _run, True, _train, False, False):
        assert used == 0
        assert_close(par, ref, rtol=1e-9, atol=1e-10)


def _nanogpt() -> tuple[dict, dict]:
    """nanoGPT (tests/outside), 1.6 M float64 parameters with its tied embedding, two micro-batches per step."""
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=256, dropout=0.0)
    build = lambda: nanogpt.GPT(config).double()  # noqa: E731
    tokens = torch.randint(0, 64, (48, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as nanoGPT's get_batch makes them
    loss = lambda model, batch: model(*batch)[1]  # noqa: E731 - nanoGPT returns (logits, loss)
    return _accumulated(build, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)], w.loader(x, y, 8, shuffle=False),
                        loss)


def _accumulated(build, whole: list, loader: torch.utils.data.DataLoader, loss) -> tuple[dict, dict]:
    """``build()`` trained two micro-batches a step: alone on ``whole`` (the global batches), and on this rank
    through parallelize(model, ``loader``) with the first under no_sync (rank 1 starts from other weights,
    which parallelize makes rank 0's). Both final states."""
    ref = _steps(w.seeded(build, 0), whole, True, torch.enable_grad, loss=loss)
    model, mine = autodist.parallelize(w.seeded(build, 0 if dist.get_rank() == 0 else 5), loader)
    model = _steps(model, list(mine), True, lambda: autodist.no_sync(model), loss=loss)
    assert state_of(model).exchange.name == "shared memory"
    return w.state(model), w.state(ref)


@pytest.mark.slow
def test_nanogpt_accumulating_through_the_own_part_gives_the_same_bits(ranks):
    direct, packed = ranks(2, _run, True, _nanogpt), ranks(2, _run, False, _nanogpt)
    for (par, ref, used), (par_packed, _, used_packed) in zip(direct, packed):
        assert used > 0 and used_packed == 0
        assert_close(par, ref, rtol=1e-9, atol=1e-10)
        assert_close(par, par_packed, rtol=0, atol=0)


def _hf_gpt2() -> tuple[dict, dict]:
    """Hugging Face GPT-2 from a config (13.6 MiB of float64 parameters, its tied embedding), dict batches
    through torch's DataLoader, two micro-batches per step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=512, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    build = lambda: transformers.GPT2LMHeadModel(config).double()  # noqa: E731
    tokens = torch.randint(0, 512, (32, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": t, "labels": t} for t in tokens]  # the model shifts the labels itself
    loss = lambda model, batch: model(**batch).loss  # noqa: E731
    return _accumulated(build, list(torch.utils.data.DataLoader(rows, batch_size=8)),
                        torch.utils.data.DataLoader(rows, batch_size=8), loss)


@pytest.mark.slow
def test_hugging_face_gpt2_accumulating_dict_batches_through_the_own_part(ranks):
    direct = ranks(2, _run, True, _hf_gpt2)
    for par, ref, used in direct:
        assert used > 0
        assert_close(par, ref, rtol=1e-9, atol=1e-10)
    assert_close(direct[1][0], direct[0][0], rtol=0, atol=0)


def test_a_part_is_cut_where_each_gradient_begins_and_ends():
    grads = [torch.arange(4.0), torch.arange(10.0, 16.0)]
    slot = torch.full((12,), -1.0)  # 10 gradient numbers, then 2 packed ones (a count and a flag, say)
    part = own_part.OwnPart(slot, own_part.segments([0, 4], grads, 2, 12), 0.5)
    cut = part.split([(2, 5), (5, 12)])
    assert [(o.lo, o.hi, o.scale) for o in cut] == [(2, 4, 0.5), (4, 5, 0.5), (5, 10, 0.5), (10, 12, 1.0)]
    assert [o.source.tolist() for o in cut] == [[2.0, 3.0], [10.0], [11.0, 12.0, 13.0, 14.0, 15.0], [-1.0, -1.0]]
    in_grads = [grads[0][2:].data_ptr(), grads[1].data_ptr(), grads[1][1:].data_ptr(), slot[10:].data_ptr()]
    assert [o.home.data_ptr() for o in cut] == [o.source.data_ptr() for o in cut] == in_grads
    assert part.outside(0, 4) == [(0, 2)] and part.outside(4, 10) == [] and part.outside(0, 12) == [(0, 2), (10, 12)]
