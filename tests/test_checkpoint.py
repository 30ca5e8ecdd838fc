"""save / load: resume gives the uninterrupted run, across layouts, written atomically, plain-loadable."""
from __future__ import annotations

import os
import random
import stat

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
import workloads as w
from test_mp import FunctionalMLP as FunctionalNet  # F.linear calls: the MP layers keep the names w1, b1, ...


def stack() -> nn.Module:
    # widths 9 and 7 split unevenly over 2 ranks; the planner makes a column/row pair, and the small
    # output layer stays replicated
    return nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return w.digits_like(16, features=12)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _rng_states() -> tuple[torch.Tensor, tuple, np.ndarray]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


# -- 1. resume after an interruption ------------------------------------------------------------

def _fresh_run(seed: int, n: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, torch.Generator]:
    # The loader's shuffle generator is the script's own; its state goes into the checkpoint's extra, so the
    # resumed run draws the very shuffles the uninterrupted one draws (reseeding per epoch would change the
    # training script itself; saving the state resumes any script, mid-stream too).
    x, y = w.digits_like(n)
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=generator)
    model, data = autodist.parallelize(w.seeded(w.mlp, seed), loader)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), data, generator


def _epochs(model: nn.Module, opt: torch.optim.Optimizer, data: DataLoader, n: int) -> None:
    for _ in range(n):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def _interrupted_and_uninterrupted(path: str, n: int):
    model, opt, data, _ = _fresh_run(0, n)
    _epochs(model, opt, data, 4)
    uninterrupted = w.state(model)

    model, opt, data, generator = _fresh_run(0, n)
    _epochs(model, opt, data, 2)
    torch.manual_seed(50 + w.rank()), random.seed(50 + w.rank()), np.random.seed(50 + w.rank())
    at_save = _rng_states()
    autodist.save(path, model, opt, epoch=2, loader_rng=generator.get_state())
    del model, opt, data, generator  # the interruption

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    model, opt, data, generator = _fresh_run(99, n)  # other weights, fresh Adam moments
    extra = autodist.load(path, model, opt)
    restored = _rng_states()
    generator.set_state(extra["loader_rng"])
    _epochs(model, opt, data, 4 - extra["epoch"])
    return uninterrupted, w.state(model), extra["epoch"], at_save, restored


@pytest.mark.parametrize("n, tolerance", [(24, 0.0), (22, 1e-6)], ids=["even-batches", "short-last-batch"])
def test_resume_gives_the_uninterrupted_run(ranks, tmp_path, n, tolerance):
    # 24 samples make three global batches of 8 per epoch: the resumed run does the very same arithmetic, bit
    # for bit. With 22 the last batch holds 6, and gradient sync scales each step's gradients by n_r / (the
    # previous step's N), then by previous N / N after the all-reduce: the first step after the resume
    # follows no step, where in the uninterrupted run it follows the 6-sample batch, so it rounds differently.
    results = ranks(2, _interrupted_and_uninterrupted, str(tmp_path / "ckpt.pt"), n)
    rank0_at_save = results[0][3]
    for uninterrupted, resumed, epoch, _, restored in results:
        assert epoch == 2
        assert_close(resumed, uninterrupted, rtol=tolerance, atol=tolerance / 10)
        # rank 0's generators, restored on every rank
        assert torch.equal(restored[0], rank0_at_save[0])
        assert restored[1] == rank0_at_save[1]
        assert np.array_equal(restored[2], rank0_at_save[2])


# -- 2. cross-layout: saved at mp=2, resumed in one process, at mp=1 and at mp=2 ---------------

def _save_at_mp2(path: str, build):
    x, y = _batch()
    model, _ = autodist.parallelize(w.seeded(build, 0), mp=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, x, y, 3)
    saved = autodist.gather_state_dict(model, all_ranks=True)
    autodist.save(path, model, opt, step=3)
    _steps(model, opt, x, y, 1)
    return saved, autodist.gather_state_dict(model, all_ranks=True)


def _resume_on_ranks(path: str, build, mp: int):
    x, y = _batch()
    model, (xs, ys) = autodist.parallelize(w.seeded(build, 1), (x, y), mp=mp)  # mp=1: each rank half the batch
    opt = torch.optim.Adam(model.parameters(), lr=0.5)  # lr comes from the checkpoint
    extra = autodist.load(path, model, opt)
    lr = opt.param_groups[0]["lr"]
    _steps(model, opt, xs, ys, 1)
    return extra, lr, autodist.gather_state_dict(model, all_ranks=True)


@pytest.fixture(scope="module", params=[stack, FunctionalNet], ids=["stack", "functional"])
def mp2_checkpoint(request, ranks, tmp_path_factory):
    """(build, path, the dense state saved, the dense state one step later) of a run at mp=2."""
    path = str(tmp_path_factory.mktemp("mp2") / "ckpt.pt")
    saved, continued = ranks(2, _save_at_mp2, path, request.param)[0]
    return request.param, path, saved, continued


def test_mp2_checkpoint_resumes_in_one_process(mp2_checkpoint):
    build, path, _, continued = mp2_checkpoint
    model = w.seeded(build, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    assert autodist.load(path, model, opt) == {"step": 3}
    assert opt.param_groups[0]["lr"] == 0.01
    _steps(model, opt, *_batch(), 1)
    assert_close(w.state(model), continued, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mp", [1, 2])
def test_mp2_checkpoint_resumes_on_two_ranks(ranks, mp2_checkpoint, mp):
    build, path, _, continued = mp2_checkpoint
    for extra, lr, state in ranks(2, _resume_on_ranks, path, build, mp):
        assert extra == {"step": 3} and lr == 0.01
        assert_close(state, continued, rtol=1e-5, atol=1e-6)


# -- 4. the model part is a plain state dict ---------------------------------------------------

def test_model_part_loads_into_the_plain_model(mp2_checkpoint):
    build, path, saved, _ = mp2_checkpoint
    plain = build()
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])  # strict
    assert_close(w.state(plain), saved, rtol=0, atol=0)


# -- 3. atomic write ---------------------------------------------------------------------------

def test_save_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "new" / "dir" / "ckpt.pt"  # parents are created
    autodist.save(path, w.seeded(w.mlp, 0), epoch=1)
    second = w.seeded(w.mlp, 1)
    autodist.save(path, second, epoch=2)  # over an existing checkpoint
    assert os.listdir(path.parent) == ["ckpt.pt"]

    def torch_save_dies_midway(obj, f, *args, **kwargs):
        f.write(b"the first half of a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torch_save_dies_midway)
    with pytest.raises(OSError, match="No space left"):
        autodist.save(path, w.seeded(w.mlp, 2), epoch=3)
    monkeypatch.undo()
    assert os.listdir(path.parent) == ["ckpt.pt"]  # no temporary file left behind
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["extra"] == {"epoch": 2}
    assert_close(checkpoint["model"], w.state(second), rtol=0, atol=0)


def test_save_fsyncs_the_file_then_renames_then_fsyncs_the_directory(tmp_path, monkeypatch):
    events, fsync, replace = [], os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        info = os.fstat(fd)
        events.append(("fsync", "directory" if stat.S_ISDIR(info.st_mode) else "file", info.st_ino))
        fsync(fd)

    def recording_replace(src, dst) -> None:
        events.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = tmp_path / "ckpt.pt"
    autodist.save(path, w.seeded(w.mlp, 0), epoch=1)
    written, directory = os.stat(path).st_ino, os.stat(tmp_path).st_ino
    # the complete file reaches the disk before its name does, and the rename itself is made durable
    assert events == [("fsync", "file", written), ("replace", written, str(path)),
                      ("fsync", "directory", directory)]


def test_checkpoint_file_format(tmp_path):
    model = w.seeded(w.mlp, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, opt, *w.digits_like(8), 1)
    autodist.save(tmp_path / "c.pt", model, opt, epoch=1, history=[0.5, 0.25], note="ok")
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(checkpoint) == {"format", "version", "model", "optimizer", "extra", "rng"}
    assert set(checkpoint["optimizer"]["state"]) == set(checkpoint["model"])  # keyed by parameter name
    assert checkpoint["optimizer"]["param_groups"][0]["params"] == list(dict(model.named_parameters()))
    assert checkpoint["extra"] == {"epoch": 1, "history": [0.5, 0.25], "note": "ok"}


# -- 5. errors ---------------------------------------------------------------------------------

class Headed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.fixture
def mlp_checkpoint(tmp_path):
    path = tmp_path / "mlp.pt"
    autodist.save(path, w.seeded(w.mlp, 0))
    return path


def test_wrong_model_names_the_missing_and_unexpected_keys(mlp_checkpoint):
    with pytest.raises(RuntimeError, match=r"missing keys .*\['body.bias', 'body.weight', 'head.bias', "
                                           r"'head.weight'\].*unexpected keys .*'0.bias', '0.weight'"):
        autodist.load(mlp_checkpoint, Headed())


def test_wrong_sizes_are_named(mlp_checkpoint):
    narrow = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(RuntimeError, match=r"size mismatch .*'0.weight': checkpoint \(16, 6\), model \(8, 6\)"):
        autodist.load(mlp_checkpoint, narrow)


def test_optimizer_errors(mlp_checkpoint, tmp_path):
    model = w.mlp()
    with pytest.raises(ValueError, match="saved without an optimizer"):
        autodist.load(mlp_checkpoint, model, torch.optim.SGD(model.parameters(), lr=0.1))
    stranger = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) of shapes \[\(2,\)\] that are not parameters"):
        autodist.save(tmp_path / "x.pt", model, stranger)
    autodist.save(tmp_path / "opt.pt", model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    split = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    with pytest.raises(ValueError, match="1 parameter group"):
        autodist.load(tmp_path / "opt.pt", model, split)
    assert not os.path.exists(tmp_path / "x.pt")


def test_unloadable_extra_and_foreign_files(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['sampler'\] is a object, which torch.load\(weights_only=True\)"):
        autodist.save(tmp_path / "c.pt", w.mlp(), sampler=object())
    torch.save(w.mlp().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="is not an autodist checkpoint"):
        autodist.load(tmp_path / "plain.pt", w.mlp())
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        autodist.load(tmp_path / "missing.pt", w.mlp())
