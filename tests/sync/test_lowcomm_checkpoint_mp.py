"""Checkpoints keep a low-communication mode's state with model parallelism (4 real gloo ranks: dp=2 x mp=2)."""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from test_checkpoint import stack  # widths 9 and 7: uneven shards over mp=2
from test_lowcomm import _loop, _plain_sgd


def _build(strategy, seed, mp=2):
    x, y = w.digits_like(8, features=12)  # one global batch: a step per epoch, 4 samples per replica
    model, data = autodist.parallelize(w.seeded(stack, seed), w.loader(x, y, 8, shuffle=False), mp=mp,
                                       sync=strategy)
    return model, data, _plain_sgd(model)  # stateless inner optimizer: equal on every replica


def _restart(path, make, before, after, forget=False):
    """``before`` steps, save, ``after`` more; then a fresh model, optimizer and strategy load the checkpoint
    and take the same ``after`` steps (``forget``: the strategy then drops the loaded state, starting afresh)."""
    strategy = make()
    model, data, opt = _build(strategy, 0)
    _loop(model, data, opt, before)
    autodist.save(path, model, opt)
    saved = strategy.state_dict()
    _loop(model, data, opt, after)
    fresh = make()
    model2, data2, opt2 = _build(fresh, 5)  # other weights, and a strategy that has seen no step
    autodist.load(path, model2, opt2)
    loaded = fresh.state_dict()
    if forget:
        fresh.load_state_dict(None)
    _loop(model2, data2, opt2, after)
    return w.state(model), w.state(model2), saved, loaded


def _diloco():
    return autodist.DiLoCo(every=2, momentum=0.5)  # Nesterov: the outer momentum must come back


def test_diloco_mp2_restart_is_the_uninterrupted_run(ranks, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for straight, resumed, saved, loaded in ranks(4, _restart, path, _diloco, 4, 4):  # saved after the 2nd sync
        assert_close(resumed, straight, rtol=1e-6, atol=1e-7)
        assert saved["outer_momentum"]  # two outer steps taken: there is momentum to lose
        for entry in ("outer_params", "outer_momentum"):  # this rank's shards, back exactly
            assert_close(loaded[entry], saved[entry], rtol=0, atol=0)
    file = torch.load(path, weights_only=True)
    outer = file["sync"]["state"]["outer_params"]
    # dense, under the original names: right after a sync the outer parameters are the model's parameters
    assert outer.keys() == {k for k, _ in stack().named_parameters()}
    assert_close(outer, {k: file["model"][k] for k in outer}, rtol=0, atol=0)


def test_diloco_mp2_restart_without_the_saved_state_differs(ranks, tmp_path):
    # the negative control: the same restart, but the strategy starts afresh from the loaded model (no outer
    # momentum), so the next outer step differs
    for straight, resumed, _, _ in ranks(4, _restart, str(tmp_path / "ckpt.pt"), _diloco, 4, 4, True):
        assert not torch.allclose(resumed["0.weight"], straight["0.weight"], rtol=1e-4, atol=1e-5)


def _local_sgd():
    return autodist.LocalSGD(every=4, warmup=2)  # averages at steps 6, 10, ...


def test_local_sgd_mp2_restart_keeps_the_step_count(ranks, tmp_path):
    # saved at step 6, right after an average; restarted with a count of 0 it would take two exact steps and
    # average at step 12, not 10
    for straight, resumed, saved, loaded in ranks(4, _restart, str(tmp_path / "ckpt.pt"), _local_sgd, 6, 6):
        assert saved == loaded == {"steps": 6, "syncs": 1}
        assert_close(resumed, straight, rtol=1e-6, atol=1e-7)


def _streamed():
    return autodist.DiLoCo(every=4, fragments=2, overlap=1, momentum=0.5)  # fragment 1 launches at step 3


def _save_mid_exchange(path):
    strategy = _streamed()
    model, data, opt = _build(strategy, 0)
    _loop(model, data, opt, 3)
    autodist.save(path, model, opt)
    return strategy.state_dict()


def _load_at(path, mp):
    strategy = _streamed()
    model, data, opt = _build(strategy, 5, mp=mp)
    autodist.load(path, model, opt)
    loaded = strategy.state_dict()
    _loop(model, data, opt, 1)  # fragment 1's outer step, on the loaded average
    return loaded, strategy.syncs, strategy.bytes_sent


def test_streamed_diloco_mp2_state_loads_at_mp2_and_at_mp1(ranks, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = ranks(4, _save_mid_exchange, path)
    assert all(s["pending_fragments"] == [1] for s in saved)
    for at_mp2, (loaded, _, _) in zip(saved, ranks(4, _load_at, path, 2)):
        for entry in ("outer_params", "outer_momentum", "pending"):
            assert_close(loaded[entry], at_mp2[entry], rtol=0, atol=0)
    dense = torch.load(path, weights_only=True)["sync"]["state"]
    for loaded, syncs, sent in ranks(4, _load_at, path, 1):  # dp=4 x mp=1: every tensor whole
        assert loaded["pending_fragments"] == [1]
        assert syncs == 2 and sent == 0  # fragment 1 stepped on the saved average: nothing sent again
        for entry in ("outer_params", "outer_momentum", "pending"):
            assert_close(loaded[entry], dense[entry], rtol=0, atol=0)


class _TensorState(autodist.LocalSGD):
    """A mode with a tensor in its state that it does not name in ``mirrors``."""

    def state_dict(self):
        return {**super().state_dict(), "scale": torch.ones(3)}


def _save_unnamed_tensor(path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        model, data, opt = _build(_TensorState(every=2), 0)
        _loop(model, data, opt, 2)
        autodist.save(path, model, opt)
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_an_unnamed_tensor_in_the_state_is_not_saved_with_mp2_and_a_warning_says_why(ranks, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for warnings in ranks(4, _save_unnamed_tensor, path):
        assert any("does not hold the state of" in m and "['scale']" in m and "mirrors" in m for m in warnings)
    assert "sync" not in torch.load(path, weights_only=True)


class _Pair(nn.Module):
    """Two Linears under the same names, registered in either order: DiLoCo's fragments are cut otherwise."""

    def __init__(self, b_first: bool = False) -> None:
        super().__init__()
        if b_first:
            self.b, self.a = nn.Linear(8, 3), nn.Linear(12, 8)
        else:
            self.a, self.b = nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _cut_otherwise(path):
    x, y = w.digits_like(8, features=12)

    def build(b_first):
        strategy = _streamed()  # fragment 0 launches at step 1: a.weight alone, or b's and a.weight with b first
        model, data = autodist.parallelize(w.seeded(lambda: _Pair(b_first), 0), w.loader(x, y, 8, shuffle=False),
                                           sync=strategy)
        return strategy, model, data, _plain_sgd(model)

    strategy, model, data, opt = build(False)
    _loop(model, data, opt, 1)
    autodist.save(path, model, opt)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        fresh, model2, data2, opt2 = build(True)
        autodist.load(path, model2, opt2)
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    pending = fresh.state_dict()["pending_fragments"]
    _loop(model2, data2, opt2, 1)  # fragment 0's outer step: its average is taken now
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING], pending, fresh.syncs, fresh.bytes_sent


def test_an_average_under_way_for_a_fragment_cut_otherwise_is_taken_again_with_a_warning(ranks, tmp_path):
    results = ranks(4, _cut_otherwise, str(tmp_path / "ckpt.pt"))  # dp=4
    for rank, (warnings, pending, syncs, sent) in enumerate(results):
        assert pending == [] and syncs == 1 and sent > 0
        assert any("taken again" in m for m in warnings) == (rank == 0)
