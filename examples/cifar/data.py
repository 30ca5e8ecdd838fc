"""Data for the example: CIFAR-10 from its python-pickle batches, or scikit-learn's digits when it is absent.

CIFAR-10 is read from ``<data_dir>/cifar-10-batches-py/`` (data_batch_1..5 and
test_batch, the format of the official ``cifar-10-python.tar.gz``). With
``download=True`` the archive is fetched and its MD5 checked first, where the
network allows. Without CIFAR-10 the example trains on scikit-learn's digits:
1,797 real 8x8 grey-scale images of handwritten digits that ship inside the
scikit-learn package, so the example runs anywhere.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import urllib.request
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class Data:
    """A train and a test set of images (N, C, H, W) with integer labels, and where they came from."""

    name: str
    train: TensorDataset
    test: TensorDataset
    classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.tensors[0].shape[1:])


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch file: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if images.ndim != 2 or images.shape[1] != 3 * 32 * 32 or len(images) != len(labels):
        raise ValueError(f"{path} is not a CIFAR-10 batch: data {images.shape}, labels {labels.shape}")
    return images.reshape(-1, 3, 32, 32), labels


def _normalise(images: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(images).float() / 255.0
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def load_cifar10(data_dir: str) -> Data:
    """CIFAR-10 from ``data_dir`` (the folder holding cifar-10-batches-py)."""
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    parts = [read_cifar_batch(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6)]
    test_x, test_y = read_cifar_batch(os.path.join(folder, "test_batch"))
    train_x, train_y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return Data("CIFAR-10", TensorDataset(_normalise(train_x), torch.from_numpy(train_y)),
                TensorDataset(_normalise(test_x), torch.from_numpy(test_y)), 10)


def cifar10_present(data_dir: str) -> bool:
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return all(os.path.isfile(os.path.join(folder, n)) for n in names)


def md5(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_cifar10(data_dir: str, timeout: float = 30.0) -> bool:
    """Fetch and unpack CIFAR-10 into ``data_dir``; False (and a reason printed) when that is not possible."""
    os.makedirs(data_dir, exist_ok=True)
    archive = os.path.join(data_dir, "cifar-10-python.tar.gz")
    try:
        if not os.path.isfile(archive):
            with urllib.request.urlopen(CIFAR_URL, timeout=timeout) as response, open(archive + ".part", "wb") as f:
                while block := response.read(1 << 20):
                    f.write(block)
            os.replace(archive + ".part", archive)
    except OSError as err:
        print(f"could not download CIFAR-10 ({err}); continuing without it")
        return False
    if md5(archive) != CIFAR_MD5:
        os.remove(archive)
        print(f"the downloaded CIFAR-10 archive failed its MD5 check ({CIFAR_MD5} expected); removed it")
        return False
    with tarfile.open(archive) as tar:
        tar.extractall(data_dir, filter="data")
    return cifar10_present(data_dir)


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Data:
    """scikit-learn's digits as (N, 1, 8, 8) images in [0, 1], split train/test with a fixed seed."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(round(len(x) * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Data("scikit-learn digits", TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), 10)


def load(data_dir: str, download: bool = False, seed: int = 0) -> Data:
    """CIFAR-10 when it is in ``data_dir`` (or can be downloaded), otherwise scikit-learn's digits."""
    if not cifar10_present(data_dir) and download:
        download_cifar10(data_dir)
    if cifar10_present(data_dir):
        return load_cifar10(data_dir)
    return load_digits(seed)
