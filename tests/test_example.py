"""The CIFAR example: its CIFAR-10 reader on a small file in CIFAR's format, and one short real run."""
from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import tarfile
from contextlib import contextmanager

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "cifar")


def _example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"cifar_example_{name}", os.path.join(EXAMPLE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
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


def _run(args: list[str], tmp_path) -> tuple[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "out"), "--no-progress"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "out" / "metrics.json") as f:
        return proc.stdout + proc.stderr, json.load(f)


@pytest.mark.e2e
def test_example_runs_one_epoch_on_two_ranks(tmp_path):
    output, metrics = _run(["-m", "autodist.cli", "run", "-n", "2", os.path.join(EXAMPLE, "train.py"),
                            "--mode", "mp", "--epochs", "1"], tmp_path)
    assert "dataset: scikit-learn digits" in output and "CIFAR-10 not found" in output
    assert metrics["ranks"] == 2 and metrics["mp"] == 2 and len(metrics["history"]) == 1
    assert metrics["history"][0]["test_accuracy"] > 50


@pytest.mark.e2e
def test_example_reads_cifar_when_present(tmp_path):
    write_fake_cifar(str(tmp_path / "data"))
    output, metrics = _run([os.path.join(EXAMPLE, "train.py"), "--model", "convnet", "--epochs", "1",
                            "--batch-size", "8"], tmp_path)
    assert "dataset: CIFAR-10 (20 train / 4 test images of 3x32x32)" in output
    assert metrics["dataset"] == "CIFAR-10"
