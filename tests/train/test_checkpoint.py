"""save / load: resume gives the uninterrupted run, across layouts, written atomically, plain-loadable."""
from __future__ import annotations

import logging
import os
import pathlib
import random
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.train import checkpoint, checkpoint_file
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


def test_a_compiled_models_state_loads_into_the_model_and_its_wrapper():
    """A state dict of torch.compile's wrapper ('_orig_mod.' before every name: what files of a compiled model
    held before autodist unwrapped it) loads into the uncompiled model, and a plain one into the wrapper."""
    source, plain = w.seeded(w.mlp, 0), w.seeded(w.mlp, 1)
    wrapped = {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}
    checkpoint.load_dense_state_dict(plain, wrapped)  # strict
    assert_close(w.state(plain), w.state(source), rtol=0, atol=0)
    target = w.seeded(w.mlp, 2)
    checkpoint.load_dense_state_dict(torch.compile(target, backend="eager"), source.state_dict())
    assert_close(w.state(target), w.state(source), rtol=0, atol=0)


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
    assert set(checkpoint) == {"format", "version", "model", "optimizer", "extra", "rng", "checksum"}
    assert checkpoint["checksum"]["algorithm"] == "crc32"
    assert len(checkpoint["checksum"]["tensors"]) == sum(  # one per tensor: weights, momenta, RNG states
        isinstance(leaf, torch.Tensor) for _, leaf in checkpoint_file.leaves(checkpoint, ""))
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


# -- 6. damaged files: a checksum verified on load, one clear error for every kind of bad file -----

def _largest_record(path) -> tuple[str, int, int]:
    """(name, offset of its bytes in the file, size) of the zip archive's largest tensor record."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:  # the bytes follow the local header: 30 bytes, the name, the extra field
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size


def test_flipped_bytes_in_a_weight_record_are_named(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = w.seeded(lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)), 0)
    autodist.save(path, model, epoch=1)
    _, offset, size = _largest_record(path)  # 0.weight: 64 x 64 floats
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        flipped = bytes(b ^ 0x5A for b in f.read(16))
        f.seek(offset + size // 2)
        f.write(flipped)
    damaged = torch.load(path, weights_only=True)["model"]["0.weight"]  # torch itself notices nothing
    assert not torch.equal(damaged, model[0].weight.detach())
    with pytest.raises(autodist.checkpoint.CheckpointError,
                       match=r"ckpt.pt' is damaged: 1 of \d+ tensors do not match the checksums saved with them "
                             r"\(\['model'\]\['0.weight'\]\).*resume from an earlier checkpoint"):
        autodist.load(path, w.seeded(lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)), 1))


def test_changed_numbers_outside_the_tensors_are_detected(tmp_path):
    path = tmp_path / "ckpt.pt"
    autodist.save(path, w.mlp(), epoch=1)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["extra"]["epoch"] = 2  # the file rewritten, its checksums not
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="is damaged: its names, shapes or numbers do not match"):
        autodist.load(path, w.mlp())


@pytest.mark.parametrize("damage, says", [
    (lambda data: data[: len(data) // 2], "it is truncated"),
    (lambda data: data[:-100], "it is truncated"),
    (lambda data: b"", "the file is empty"),
    (lambda data: bytes(random.Random(0).getrandbits(8) for _ in range(4096)), "does not start as a zip archive"),
    (lambda data: b"hello world\n" * 10, "does not start as a zip archive"),
], ids=["half", "tail-cut", "empty", "random-bytes", "text"])
def test_truncated_and_garbage_files_give_one_clear_error(tmp_path, damage, says):
    path = tmp_path / "ckpt.pt"
    autodist.save(path, w.mlp(), epoch=1)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(autodist.checkpoint.CheckpointError) as caught:
        autodist.load(path, w.mlp())
    message = str(caught.value)
    assert message.startswith(f"cannot read the checkpoint {str(path)!r}: ") and says in message
    assert "earlier checkpoint" in message and "weights_only=False" not in message


def test_files_that_are_not_autodist_checkpoints(tmp_path):
    torch.save(object, tmp_path / "pickled-class.pt")  # a zip archive weights_only refuses
    with pytest.raises(ValueError, match=r"refuses, so it was not written by autodist.save, or it is damaged"):
        autodist.load(tmp_path / "pickled-class.pt", w.mlp())
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"is not an autodist checkpoint .*found list"):
        autodist.load(tmp_path / "list.pt", w.mlp())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def autodist_log():
    handler, logger = _Records(), logging.getLogger("autodist")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path, autodist_log):
    # what autodist wrote before checksums: the same format, no "checksum" entry
    path = tmp_path / "old.pt"
    model = w.seeded(w.mlp, 0)
    autodist.save(path, model, epoch=4)
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["checksum"]
    torch.save(checkpoint, path)
    loaded = w.mlp()
    assert autodist.load(path, loaded) == {"epoch": 4}
    assert_close(w.state(loaded), w.state(model), rtol=0, atol=0)
    assert any("has no checksums" in m and "loaded without verifying" in m for m in autodist_log)


# -- 7. stale temporaries of a save killed mid-write ---------------------------------------------

_WRITER = """
import sys, torch, autodist
from torch import nn
model = nn.Linear(4096, 4096)  # 64 MiB: each save writes for a while
autodist.save(sys.argv[1], model, epoch=0)
for epoch in range(1, 1000):
    autodist.save(sys.argv[1], model, epoch=epoch)
"""


def _temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def _being_written(directory) -> bool:
    for name in _temporaries(directory):
        try:
            if os.path.getsize(directory / name) > 0:
                return True
        except FileNotFoundError:  # renamed over the checkpoint meanwhile
            continue
    return False


def _kill_mid_write(path) -> str:
    """Start a process saving to ``path`` in a loop, SIGKILL it while a temporary is being written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not path.exists():  # the first save is complete
            time.sleep(0.01)
        while time.monotonic() < deadline and not _being_written(path.parent):
            time.sleep(0.001)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    leftovers = _temporaries(path.parent)
    assert len(leftovers) == 1, f"the writer was not killed mid-write: {os.listdir(path.parent)}"
    return leftovers[0]


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_the_last_checkpoint_and_the_next_save_cleans_up(tmp_path, autodist_log):
    path = tmp_path / "ckpt.pt"
    leftover = _kill_mid_write(path)
    assert leftover.startswith(".ckpt.pt.") and os.path.getsize(tmp_path / leftover) > 0
    epoch = autodist.load(path, nn.Linear(4096, 4096))["epoch"]  # the last complete checkpoint, verified
    assert epoch >= 0
    autodist.save(path, w.mlp(), epoch=epoch + 1)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert autodist.load(path, w.mlp()) == {"epoch": epoch + 1}
    assert any(f"removed 1 temporary file(s) of {path}" in m and leftover in m for m in autodist_log)


def test_only_this_checkpoints_temporaries_of_dead_writers_are_removed(tmp_path):
    machine = checkpoint_file._MACHINE
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "dead writer": f".ckpt.pt.{machine}-{dead.pid}-{'a' * 12}.tmp",
        "live writer": f".ckpt.pt.{machine}-{live.pid}-{'b' * 12}.tmp",
        "other machine, fresh": f".ckpt.pt.0badf00d-{dead.pid}-{'c' * 12}.tmp",
        "other machine, 2 hours old": f".ckpt.pt.0badf00d-{live.pid}-{'d' * 12}.tmp",
        "no writer named, fresh": f".ckpt.pt.{'e' * 12}.tmp",
        "no writer named, 2 hours old": f".ckpt.pt.{'f' * 12}.tmp",
        "another checkpoint's, dead writer": f".other.pt.{machine}-{dead.pid}-{'a' * 12}.tmp",
        "not a temporary": "ckpt.pt.bak",
    }
    try:
        for what, name in names.items():
            (tmp_path / name).write_bytes(b"partial")
            if "2 hours old" in what:
                os.utime(tmp_path / name, (time.time() - 7200, time.time() - 7200))
        autodist.save(tmp_path / "ckpt.pt", w.mlp())
    finally:
        live.kill()
        live.wait()
    removed = {what for what, name in names.items() if not (tmp_path / name).exists()}
    assert removed == {"dead writer", "other machine, 2 hours old", "no writer named, 2 hours old"}


# -- 8. resume: the checkpoint if there is one, the defaults if not ------------------------------

def test_resume_without_then_with_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt" / "last.pt"
    model = w.seeded(w.mlp, 0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert autodist.resume(path, model, opt, epoch=0, best=None) == {"epoch": 0, "best": None}
    _steps(model, opt, *w.digits_like(8), 2)
    autodist.save(path, model, opt, epoch=3)
    _steps(model, opt, *w.digits_like(8), 1)
    expected = w.state(model)

    resumed = w.seeded(w.mlp, 1)
    opt = torch.optim.Adam(resumed.parameters(), lr=0.5)
    assert autodist.resume(path, resumed, opt, epoch=0, best=None) == {"epoch": 3, "best": None}
    _steps(resumed, opt, *w.digits_like(8), 1)
    assert_close(w.state(resumed), expected, rtol=0, atol=0)


def test_resume_never_restarts_silently_from_a_damaged_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    autodist.save(path, w.mlp(), epoch=3)
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="is truncated"):
        autodist.resume(path, w.mlp(), epoch=0)


def _resume_from_rank_paths(directory: str):
    autodist.save(os.path.join(directory, "shared.pt"), w.seeded(w.mlp, 0), epoch=2)
    mine = "shared.pt" if w.rank() == 0 else "missing.pt"  # as if rank 1's node did not share the directory
    try:
        autodist.resume(os.path.join(directory, mine), w.mlp(), epoch=0)
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_that_see_different_checkpoints_are_told(ranks, tmp_path):
    for message in ranks(2, _resume_from_rank_paths, str(tmp_path)):
        assert message is not None and message.startswith("ranks [1] see no checkpoint at")
        assert "file system every node shares" in message


# -- 9. arguments ------------------------------------------------------------------------------

def _model_and_optimizer():
    model = w.mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _bad_arguments(tmp: pathlib.Path) -> list[tuple[str, str, dict, type, str]]:
    """(id, function, arguments, exception, message) of calls that must fail before doing anything."""
    model, opt = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    (tmp / "a-file").write_bytes(b"")
    good = str(tmp / "ckpt.pt")
    return [
        ("optimizer-str", "save", dict(path=good, model=model, optimizer="sgd"), TypeError,
         r"Expect torch.optim.Optimizer or None for optimizer, str 'sgd' found"),
        ("optimizer-class", "save", dict(path=good, model=model, optimizer=torch.optim.SGD), TypeError,
         "Expect torch.optim.Optimizer or None for optimizer, type"),
        ("optimizer-scheduler", "save", dict(path=good, model=model, optimizer=scheduler), TypeError,
         r"the LR scheduler StepLR found; pass its optimizer.*scheduler=scheduler.state_dict\(\)"),
        ("model-str", "save", dict(path=good, model="mlp"), TypeError, "Expect nn.Module for model, str found"),
        ("model-class", "save", dict(path=good, model=nn.Linear), TypeError,
         r"Expect an nn.Module instance for model, the class Linear found"),
        ("model-state-dict", "save", dict(path=good, model=model.state_dict()), TypeError,
         "Expect nn.Module for model, OrderedDict found"),
        ("path-directory", "save", dict(path=tmp, model=model), ValueError,
         r"path .* names a directory; give a file in it, e.g. .*last.pt"),
        ("path-trailing-slash", "save", dict(path=str(tmp / "new") + "/", model=model), ValueError,
         "names a directory"),
        ("path-under-a-file", "save", dict(path=tmp / "a-file" / "ckpt.pt", model=model), ValueError,
         r"a-file' is a file, not a directory"),
        ("path-int", "save", dict(path=3, model=model), TypeError,
         r"Expect a file name \(str or os.PathLike\) for path, int found"),
        ("path-bytes", "save", dict(path=b"ckpt.pt", model=model), TypeError, "bytes b'ckpt.pt' found; decode"),
        ("path-empty", "save", dict(path="", model=model), ValueError, "path is empty"),
        ("path-none", "save", dict(path=None, model=model), TypeError, "for path, NoneType found"),
        ("extra-object", "save", dict(path=good, model=model, sampler=object()), TypeError,
         r"extra\['sampler'\] is a object"),
        ("load-directory", "load", dict(path=tmp, model=model), ValueError, "names a directory"),
        ("load-missing", "load", dict(path=tmp / "missing.pt", model=model), FileNotFoundError,
         "no checkpoint at"),
        ("load-model-none", "load", dict(path=good, model=None), TypeError, "Expect nn.Module for model"),
        ("load-optimizer-dict", "load", dict(path=good, model=model, optimizer=opt.state_dict()), TypeError,
         "for optimizer, dict"),
        ("resume-optimizer-str", "resume", dict(path=good, model=model, optimizer="adam"), TypeError,
         "for optimizer, str 'adam' found"),
        ("resume-directory", "resume", dict(path=tmp, model=model), ValueError, "names a directory"),
        ("resume-model-list", "resume", dict(path=good, model=[model]), TypeError,
         "Expect nn.Module for model, list found"),
    ]


_BAD_IDS = [case[0] for case in _bad_arguments(pathlib.Path(tempfile.mkdtemp()))]


@pytest.mark.parametrize("case", _BAD_IDS)
def test_bad_arguments_are_named(tmp_path, case):
    _, function, arguments, error, message = next(c for c in _bad_arguments(tmp_path) if c[0] == case)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(error, match=message):
        getattr(autodist, function)(**arguments)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written
