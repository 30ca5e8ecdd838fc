"""The CIFAR example: its reader and download on small files the tests write, its table and plots, short real runs."""
from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import pytest
import torch

from autodist import engine

pytestmark = pytest.mark.slow  # jobs through the real launcher: the full tier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "cifar")


def _example_module(name: str):
    """examples/cifar/<name>.py, loaded as the scripts load it (siblings importable), leaving sys.path as it was."""
    spec = importlib.util.spec_from_file_location(f"cifar_example_{name}", os.path.join(EXAMPLE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    before = set(sys.modules)
    sys.path.insert(0, EXAMPLE)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(EXAMPLE)
        for key in set(sys.modules) - before:  # the siblings (`import plots`) under their bare names
            if os.path.dirname(getattr(sys.modules[key], "__file__", None) or "") == EXAMPLE:
                del sys.modules[key]
    return module


def write_fake_cifar(root: str, per_batch: int = 4) -> np.ndarray:
    """CIFAR-10's python format: pickled dicts of b'data' (N x 3072 uint8) and b'labels'."""
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        first = images if first is None else first
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"data": images, b"labels": [int(i) % 10 for i in range(per_batch)]}, f)
    return first


def test_cifar_reader_on_a_file_in_cifar_format(tmp_path):
    data = _example_module("data")
    first = write_fake_cifar(str(tmp_path))
    assert data.cifar10_present(str(tmp_path))
    loaded = data.load(str(tmp_path))
    assert loaded.name == "CIFAR-10" and loaded.image_shape == (3, 32, 32)
    assert (len(loaded.train), len(loaded.test)) == (20, 4)
    assert loaded.train.images.dtype == torch.uint8  # normalised per item, not held as float32
    x0, _ = loaded.train[0]
    expected = (torch.from_numpy(first[0].reshape(3, 32, 32)).float() / 255
                - torch.tensor(data.CIFAR_MEAN).view(3, 1, 1)) / torch.tensor(data.CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x0, expected)  # channel-major layout, normalised
    assert x0.dtype == torch.float32
    assert [int(loaded.train[i][1]) for i in range(4)] == [0, 1, 2, 3]


def test_cifar_reader_rejects_other_files(tmp_path):
    data = _example_module("data")
    path = tmp_path / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 10), dtype=np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match="is not a CIFAR-10 batch"):
        data.read_cifar_batch(str(path))


def test_without_cifar_the_example_uses_digits(tmp_path):
    data = _example_module("data")
    loaded = data.load(str(tmp_path / "absent"))
    assert loaded.name == "scikit-learn digits" and loaded.image_shape == (1, 8, 8)
    assert len(loaded.train) + len(loaded.test) == 1797
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    x, _ = loaded.train[0]
    assert x.dtype == torch.float32 and float(x.max()) <= 1.0
    assert any(torch.equal(x[0], image) for image in images)  # grey levels / 16, exactly as stored


# -- download: a file:// archive the test writes ------------------------------------------------

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def example_log():
    """The lines the example logs through engine.rank_logger() (rank-prefixed)."""
    lines, logger = _Lines(), logging.getLogger("autodist.train")
    logger.addHandler(lines)
    try:
        yield lines.lines
    finally:
        logger.removeHandler(lines)


def write_cifar_archive(root: str) -> tuple[str, str]:
    """A cifar-10-python.tar.gz in CIFAR's layout (tiny batches) under root; (its file:// URL, its MD5)."""
    write_fake_cifar(os.path.join(root, "src"))
    archive = os.path.join(root, "cifar-10-python.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(os.path.join(root, "src", "cifar-10-batches-py"), arcname="cifar-10-batches-py")
    with open(archive, "rb") as f:
        return "file://" + archive, hashlib.md5(f.read()).hexdigest()


@pytest.mark.parametrize("data_filter", [True, False] if hasattr(tarfile, "data_filter") else [False],
                         ids=lambda f: "data-filter" if f else "checked-members")
def test_download_with_the_right_md5_unpacks_cifar(tmp_path, data_filter):
    data = _example_module("data")
    url, md5 = write_cifar_archive(str(tmp_path / "server"))
    target = str(tmp_path / "data")
    with example_log() as lines:
        assert data.download_cifar10(target, url=url, md5sum=md5, data_filter=data_filter)
    assert lines == [f"[rank 0/1] downloading CIFAR-10 from {url}"]
    assert sorted(os.listdir(target)) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]  # no temporaries left
    loaded = data.load(target)
    assert loaded.name == "CIFAR-10" and (len(loaded.train), len(loaded.test)) == (20, 4)


def test_load_downloads_then_reads_cifar(tmp_path):
    data = _example_module("data")
    url, md5 = write_cifar_archive(str(tmp_path / "server"))
    assert data.load(str(tmp_path / "data"), download=True, url=url, md5sum=md5).name == "CIFAR-10"


def test_download_with_a_wrong_md5_removes_the_archive_and_falls_back(tmp_path):
    data = _example_module("data")
    url, _ = write_cifar_archive(str(tmp_path / "server"))
    target = str(tmp_path / "data")
    with example_log() as lines:
        assert not data.download_cifar10(target, url=url, md5sum="0" * 32)
        loaded = data.load(target, download=True, url=url, md5sum="0" * 32)
    assert loaded.name == "scikit-learn digits"
    assert os.listdir(target) == []  # the bad archive is gone, nothing unpacked
    assert lines[1] == f"[rank 0/1] the CIFAR-10 archive failed its MD5 check ({'0' * 32} expected); removed it"


class _CutShort:
    """A response whose body ends early, as http.client reports it."""

    def __enter__(self) -> "_CutShort":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def read(self, *args: object) -> bytes:
        raise http.client.IncompleteRead(b"partial", 1000)


@pytest.mark.parametrize("failure", ["missing", "incomplete"])
def test_a_failed_download_leaves_nothing_behind(tmp_path, monkeypatch, failure):
    data = _example_module("data")
    url = "file://" + str(tmp_path / "no-such-archive.tar.gz")
    if failure == "incomplete":  # not an OSError: it must be caught too
        monkeypatch.setattr(data.urllib.request, "urlopen", lambda *args, **kwargs: _CutShort())
    target = str(tmp_path / "data")
    with example_log() as lines:
        assert data.load(target, download=True, url=url).name == "scikit-learn digits"
    assert os.listdir(target) == []
    error = "IncompleteRead" if failure == "incomplete" else "URLError"
    assert lines[-1].startswith(f"[rank 0/1] could not download CIFAR-10 ({error}")


def test_an_incomplete_cifar_folder_is_left_alone_and_named(tmp_path):
    data = _example_module("data")
    url, md5 = write_cifar_archive(str(tmp_path / "server"))
    os.makedirs(tmp_path / "data" / "cifar-10-batches-py")  # an earlier unpack was cut short
    with example_log() as lines:
        assert not data.download_cifar10(str(tmp_path / "data"), url=url, md5sum=md5)
    assert len(lines) == 1 and "cifar-10-batches-py exists but lacks some of data_batch_1" in lines[0]
    assert "remove it and rerun" in lines[0] and os.listdir(tmp_path / "data") == ["cifar-10-batches-py"]


def _load_with_download(target: str, url: str, md5: str) -> tuple[str, list[str], list[str]]:
    data = _example_module("data")
    with example_log() as lines:
        loaded = data.load(target, download=True, url=url, md5sum=md5)
    return loaded.name, lines, sorted(os.listdir(target))


def test_on_two_ranks_one_downloads_and_both_read_cifar(ranks, tmp_path):
    url, md5 = write_cifar_archive(str(tmp_path / "server"))
    results = ranks(2, _load_with_download, str(tmp_path / "data"), url, md5)
    assert [name for name, _, _ in results] == ["CIFAR-10", "CIFAR-10"]  # rank 1 waited for rank 0
    assert results[0][1] == [f"[rank 0/2] downloading CIFAR-10 from {url}"] and results[1][1] == []
    assert results[1][2] == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]


def test_unpacking_refuses_paths_outside_the_folder_without_tarfiles_filter(tmp_path):
    data = _example_module("data")
    archive = str(tmp_path / "evil.tar")
    (tmp_path / "payload").write_text("x")
    with tarfile.open(archive, "w") as tar:
        tar.add(str(tmp_path / "payload"), arcname="cifar-10-batches-py/../../escaped")
    with tarfile.open(archive) as tar, pytest.raises(ValueError, match="refusing to unpack"):
        data.checked_members(tar)
    link = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with tarfile.open(archive, "w") as tar:
        tar.addfile(link)
    with tarfile.open(archive) as tar, pytest.raises(ValueError, match="refusing to unpack"):
        data.checked_members(tar)


# -- the results table and the plots -------------------------------------------------------------

def made_up_metrics(ranks: int, mode: str, loss: float, accuracy: float) -> dict:
    history = [{"epoch": e, "train_loss": loss * (3 - e), "train_accuracy": 80.0 + e, "test_loss": 0.5 / e,
                "test_accuracy": accuracy - 2 + e, "seconds": 0.1 * e} for e in (1, 2)]
    return {"dataset": "scikit-learn digits", "mode": mode, "model": "mlp", "ranks": ranks, "mp": 1,
            "batch_size": 32, "lr": 0.05, "history": history}


def test_results_table():
    compare = _example_module("compare")
    text = compare.table([("1 process", made_up_metrics(1, "dp", 0.0667, 96.38)),
                          ("2 ranks, mp", made_up_metrics(2, "mp", 0.12345, 95.5))])
    assert text == (
        "Dataset: scikit-learn digits, model: mlp, 2 epochs, global batch 32, SGD + momentum.\n\n"
        "| run | final train loss | test accuracy | time per epoch |\n"
        "|---|---|---|---|\n"
        "| 1 process | 0.0667 | 96.38% | 0.15 s |\n"  # the last epoch's numbers; the mean time of both
        "| 2 ranks, mp | 0.1235 | 95.50% | 0.15 s |\n")


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_of_several_runs_and_of_one(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _example_module("plots")
    results = [("1 process", made_up_metrics(1, "dp", 0.0667, 96.38)),
               ("2 ranks, dp", made_up_metrics(2, "dp", 0.07, 96.0))]
    plots.plot_runs(results, str(tmp_path / "results.png"))
    assert plots.plot_run(results[1][1], str(tmp_path / "metrics.png"))
    assert _is_png(tmp_path / "results.png") and _is_png(tmp_path / "metrics.png")


def test_without_matplotlib_one_line_says_there_is_no_plot(tmp_path, monkeypatch):
    plots = _example_module("plots")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with example_log() as lines:
        assert not plots.plot_run(made_up_metrics(1, "dp", 0.1, 90.0), str(tmp_path / "metrics.png"),
                                  engine.rank_logger())
    assert len(lines) == 1 and lines[0].startswith("[rank 0/1] no plot written: matplotlib is not installed")
    assert not os.path.exists(tmp_path / "metrics.png")


# -- end to end ----------------------------------------------------------------------------------

TRAIN = os.path.join(EXAMPLE, "train.py")
DIGITS_LINE = ("[rank 0/{}] dataset: scikit-learn digits (1438 train / 359 test images of 1x8x8); "
               "CIFAR-10 not found in 'data'")
TORCHRUN_BANNER = ("*" * 41, "Setting OMP_NUM_THREADS environment variable")  # torchrun's, not a log line


class Run(NamedTuple):
    output: list[str]  # stdout and stderr lines, in order
    metrics: dict  # metrics.json
    out: str  # the --out folder


def _run(folder, ranks: int, *args: str) -> Run:
    """train.py in ``folder`` (no CIFAR-10 there) on ``ranks`` processes, writing into ``folder``/out."""
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, TRAIN]
    if ranks > 1:  # as a user launches it; torchrun sets OMP_NUM_THREADS=1 per worker and prints its banner
        env.pop("OMP_NUM_THREADS")
        command = [sys.executable, "-m", "autodist", "run", "-n", str(ranks), TRAIN]
    proc = subprocess.run([*command, *args, "--out", "out", "--no-progress"], cwd=str(folder), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    out = os.path.join(folder, "out")
    lines = proc.stdout.splitlines() if ranks == 1 else _unlabelled(proc.stdout.splitlines())
    with open(os.path.join(out, "metrics.json")) as f:
        return Run(lines, json.load(f), out)


def _unlabelled(output: list[str]) -> list[str]:
    """The lines of a run under `autodist run` without the label it puts on every rank's line ("[rank1]: ");
    torchrun's banner has none."""
    lines = []
    for line in output:
        if line.strip() and not line.startswith(TORCHRUN_BANNER):
            label = re.match(r"\[rank\d+\]: ", line)
            assert label is not None, f"a line without its rank: {line!r}"
            line = line[label.end():]
        lines.append(line)
    return lines


def _log_lines(output: list[str]) -> list[str]:
    """What the run printed apart from torchrun's banner, in order."""
    return [line for line in output if line.strip() and not line.startswith(TORCHRUN_BANNER)]


# Three short runs on digits, shared by the tests below: 2 ranks dp train 2 epochs uninterrupted; one
# process trains 1 epoch and checkpoints it; 2 ranks mp resume that checkpoint to epoch 2.

@pytest.fixture(scope="module")
def two_ranks_dp(tmp_path_factory) -> Run:
    return _run(tmp_path_factory.mktemp("dp"), 2, "--epochs", "2")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Run, Run]:
    """One process for 1 epoch with --checkpoint, then 2 ranks mp resuming from it to epoch 2."""
    checkpoint = str(tmp_path_factory.mktemp("checkpoint") / "ckpt.pt")
    saved = _run(tmp_path_factory.mktemp("one"), 1, "--epochs", "1", "--checkpoint", checkpoint)
    resumed = _run(tmp_path_factory.mktemp("mp"), 2, "--mode", "mp", "--epochs", "2", "--checkpoint", checkpoint)
    return saved, resumed


@pytest.mark.e2e
def test_hybrid_on_two_ranks_is_refused_naming_the_ranks_it_needs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", TRAIN, "--mode", "hybrid"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("autodist run: rank ") and "failed (exit code 1): train.py: --mode hybrid needs an even " \
        "number of ranks, 4 or more" in last and "this run has 2: start it with -n 4" in last, last


@pytest.mark.e2e
def test_first_log_line_says_the_dataset(two_ranks_dp, interrupted):
    for run, ranks in ((two_ranks_dp, 2), (interrupted[0], 1), (interrupted[1], 2)):
        assert _log_lines(run.output)[0] == DIGITS_LINE.format(ranks)  # digits, and that CIFAR-10 was not found
    assert any(line.startswith(TORCHRUN_BANNER[1]) for line in two_ranks_dp.output)  # there, but not a log line
    metrics = two_ranks_dp.metrics
    assert metrics["dataset"] == "scikit-learn digits" and metrics["ranks"] == 2 and metrics["mp"] == 1


@pytest.mark.e2e
def test_layouts_agree_on_test_accuracy(two_ranks_dp, interrupted):
    dp, one, mp = (run.metrics["history"] for run in (two_ranks_dp, *interrupted))
    assert len(dp) == 2 and len(one) == 1 and interrupted[1].metrics["mp"] == 2
    assert abs(one[0]["test_accuracy"] - dp[0]["test_accuracy"]) <= 0.5  # epoch 1: one process vs 2 ranks dp
    assert abs(mp[1]["test_accuracy"] - dp[1]["test_accuracy"]) <= 0.5  # epoch 2: 2 ranks mp vs 2 ranks dp
    assert dp[1]["test_accuracy"] > 80


@pytest.mark.e2e
def test_local_sgd_run_reports_the_spread_and_ends_near_exact_sync(two_ranks_dp, tmp_path):
    run = _run(tmp_path, 2, "--epochs", "2", "--sync", "local-sgd")
    assert run.metrics["sync"] == "local-sgd" and two_ranks_dp.metrics["sync"] == "exact"
    epochs = [line for line in _log_lines(run.output) if "| train loss" in line]
    assert len(epochs) == 2 and all(float(line.split("spread ")[1].split()[0]) > 0 for line in epochs)
    local, exact = run.metrics["history"][-1], two_ranks_dp.metrics["history"][-1]
    assert local["test_accuracy"] > 80 and abs(local["test_accuracy"] - exact["test_accuracy"]) <= 3
    assert "sync=LocalSGD(every=16" in "\n".join(run.output)


@pytest.mark.e2e
def test_resume_at_another_layout_continues_the_run(two_ranks_dp, interrupted):
    saved, resumed = (run.metrics["history"] for run in interrupted)
    assert any(line.startswith("[rank 0/2] resumed from ") and line.endswith("ckpt.pt after epoch 1")
               for line in interrupted[1].output)
    assert resumed[0] == saved[0]  # carried in the checkpoint
    # Against the uninterrupted run: the layouts add partial sums in different orders (one process vs an
    # all-reduce of 2 ranks' gradients; mp's split layers), so losses agree to rounding (~1e-8 relative
    # here), not bit for bit; the counts of correct predictions, hence the accuracies, are the same.
    uninterrupted = two_ranks_dp.metrics["history"]
    assert [h["epoch"] for h in resumed] == [1, 2]
    for got, expected in zip(resumed, uninterrupted):
        for key in ("train_accuracy", "test_accuracy"):
            assert got[key] == expected[key], key
        for key in ("train_loss", "test_loss"):
            assert got[key] == pytest.approx(expected[key], rel=1e-6), key


@pytest.mark.e2e
def test_each_run_writes_its_plot(two_ranks_dp, interrupted):
    pytest.importorskip("matplotlib")
    for run in (two_ranks_dp, *interrupted):
        assert sorted(os.listdir(run.out)) == ["metrics.json", "metrics.png"]
        assert _is_png(os.path.join(run.out, "metrics.png"))


@pytest.mark.e2e
def test_example_reads_cifar_when_present(tmp_path):
    write_fake_cifar(str(tmp_path / "data"))
    run = _run(tmp_path, 1, "--model", "convnet", "--epochs", "1", "--batch-size", "8")
    assert _log_lines(run.output)[0] == "[rank 0/1] dataset: CIFAR-10 (20 train / 4 test images of 3x32x32)"
    assert run.metrics["dataset"] == "CIFAR-10"
