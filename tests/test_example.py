"""The CIFAR example: its CIFAR-10 reader on a small file in CIFAR's format, and one short real run."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys

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
    x, y = loaded.train.tensors
    expected = (torch.from_numpy(first[0].reshape(3, 32, 32)).float() / 255
                - torch.tensor(data.CIFAR_MEAN).view(3, 1, 1)) / torch.tensor(data.CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x[0], expected)  # channel-major layout, normalised
    assert y[:4].tolist() == [0, 1, 2, 3]


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
