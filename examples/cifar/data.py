"""Data for the example: CIFAR-10 from its python-pickle batches, or scikit-learn's digits when it is absent.

CIFAR-10 is read from ``<data_dir>/cifar-10-batches-py/`` (data_batch_1..5 and
test_batch, the format of the official ``cifar-10-python.tar.gz``). With
``download=True`` the archive is fetched and its MD5 checked first, where the
network allows. Without CIFAR-10 the example trains on scikit-learn's digits:
1,797 real 8x8 grey-scale images of handwritten digits that ship inside the
scikit-learn package, so the example runs anywhere.

Example:
    >>> data = load("data", download=True)      # every rank calls it
    >>> data.name, data.image_shape
    ('CIFAR-10', (3, 32, 32))
"""
from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import autodist
from autodist import engine

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class Images(Dataset):
    """uint8 images and their labels; item ``i`` is ``((images[i] / scale - mean) / std, labels[i])`` in float32.

    The images stay in their stored bytes and are normalised one item at a
    time: CIFAR-10 takes 184 MB per rank as uint8, four times that as float32.

    Example:
        >>> images = Images(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), 255.0,
        ...                 CIFAR_MEAN, CIFAR_STD)
        >>> x, y = images[1]
        >>> x.shape, x.dtype, int(y)
        (torch.Size([3, 4, 4]), torch.float32, 1)
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, scale: float,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels) or not len(mean) == len(std) == images.shape[1]:
            raise ValueError(f"{len(images)} images of {images.shape[1]} channels, {len(labels)} labels, "
                             f"{len(mean)} means and {len(std)} stds do not fit together")
        self.images, self.labels, self.scale = images, labels, float(scale)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.images[index].float() / self.scale - self.mean) / self.std, self.labels[index]


@dataclass
class Data:
    """A train and a test set of images (C, H, W) with integer labels, and where they came from."""

    name: str
    train: Images
    test: Images
    classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.images.shape[1:])


# -- CIFAR-10 from its python batches ------------------------------------------------------------

def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch file: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if images.ndim != 2 or images.shape[1] != 3 * 32 * 32 or len(images) != len(labels):
        raise ValueError(f"{path} is not a CIFAR-10 batch: data {images.shape}, labels {labels.shape}")
    return images.reshape(-1, 3, 32, 32), labels


def _cifar_images(images: np.ndarray, labels: np.ndarray) -> Images:
    return Images(torch.from_numpy(images), torch.from_numpy(labels), 255.0, CIFAR_MEAN, CIFAR_STD)


def load_cifar10(data_dir: str) -> Data:
    """CIFAR-10 from ``data_dir`` (the folder holding cifar-10-batches-py)."""
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    parts = [read_cifar_batch(os.path.join(folder, name)) for name in CIFAR_FILES[:-1]]
    test_x, test_y = read_cifar_batch(os.path.join(folder, CIFAR_FILES[-1]))
    train_x, train_y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return Data("CIFAR-10", _cifar_images(train_x, train_y), _cifar_images(test_x, test_y), 10)


def cifar10_present(data_dir: str) -> bool:
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    return all(os.path.isfile(os.path.join(folder, name)) for name in CIFAR_FILES)


# -- download ------------------------------------------------------------------------------------

def md5(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checked_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's members if each is a plain file or folder that unpacks inside the destination.

    What tarfile's ``filter="data"`` enforces, for Pythons without it (before 3.10.12 / 3.11.4):
    no absolute paths, no ``..``, no links or devices; permission bits beyond 0o755 are dropped.
    """
    members = tar.getmembers()
    for member in members:
        parts = member.name.replace("\\", "/").split("/")
        if not (member.isfile() or member.isdir()) or os.path.isabs(member.name) or ".." in parts:
            raise ValueError(f"refusing to unpack {member.name!r}: the archive should hold only plain files and "
                             f"folders inside {CIFAR_FOLDER!r}")
        member.mode &= 0o755
    return members


def _fetch(url: str, archive: str, timeout: float) -> None:
    """Download ``url`` to ``archive`` through a temporary file of this process's own, renamed when complete."""
    fd, part = tempfile.mkstemp(prefix=f".{os.path.basename(archive)}.", suffix=".part",
                                dir=os.path.dirname(archive))
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, f, 1 << 20)
        os.replace(part, archive)
    finally:
        if os.path.exists(part):
            os.remove(part)


def _extract(archive: str, data_dir: str, data_filter: bool) -> None:
    """Unpack into a fresh folder of this process's own beside the final one, then rename CIFAR's folder into place."""
    staging = tempfile.mkdtemp(prefix=".cifar-unpack-", dir=data_dir)
    try:
        with tarfile.open(archive) as tar:
            if data_filter:
                tar.extractall(staging, filter="data")
            else:
                tar.extractall(staging, members=checked_members(tar))
        os.replace(os.path.join(staging, CIFAR_FOLDER), os.path.join(data_dir, CIFAR_FOLDER))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_cifar10(data_dir: str, *, url: str = CIFAR_URL, md5sum: str = CIFAR_MD5, timeout: float = 30.0,
                     data_filter: bool = hasattr(tarfile, "data_filter")) -> bool:
    """Fetch ``url``, check its MD5 and unpack CIFAR-10 into ``data_dir``, in this process.

    Args:
        data_dir: where ``cifar-10-batches-py`` should appear; the archive is kept beside it.
        url: the archive (``file://`` works too).
        md5sum: its expected MD5; an archive that differs is removed.
        timeout: seconds a stalled connection may wait.
        data_filter: unpack with tarfile's ``filter="data"`` (Python 3.10.12+, 3.11.4+), else with
            :func:`checked_members`.

    Returns:
        Whether CIFAR-10 is now in ``data_dir``. When not, one log line says why.

    Example:
        >>> download_cifar10("data")
        True

    Note:
        Safe beside another process doing the same (temporary names are per process, and files appear
        under their final names only when complete), but :func:`load` lets one process per machine do it.
    """
    log = engine.rank_logger()
    folder = os.path.join(data_dir, CIFAR_FOLDER)
    if os.path.exists(folder):
        log.warning("%s exists but lacks some of %s; remove it and rerun to download CIFAR-10 again",
                    folder, ", ".join(CIFAR_FILES))
        return False
    os.makedirs(data_dir, exist_ok=True)
    archive = os.path.join(data_dir, CIFAR_ARCHIVE)
    try:
        if not os.path.isfile(archive):
            log.info("downloading CIFAR-10 from %s", url)
            _fetch(url, archive, timeout)
    except (OSError, http.client.HTTPException) as err:  # URLError and timeouts are OSErrors; IncompleteRead is not
        log.warning("could not download CIFAR-10 (%s: %s); continuing without it", type(err).__name__, err)
        return False
    if md5(archive) != md5sum:
        os.remove(archive)
        log.warning("the CIFAR-10 archive failed its MD5 check (%s expected); removed it", md5sum)
        return False
    try:
        _extract(archive, data_dir, data_filter)
    except (OSError, tarfile.TarError, ValueError) as err:
        if not cifar10_present(data_dir):  # else another process put it in place first
            log.warning("could not unpack %s (%s); continuing without CIFAR-10", archive, err)
    return cifar10_present(data_dir)


# -- digits, and the choice ----------------------------------------------------------------------

def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Data:
    """scikit-learn's digits as (1, 8, 8) images in [0, 1], split train/test with a fixed seed."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.uint8).unsqueeze(1)  # grey levels 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(round(len(x) * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Data("scikit-learn digits", Images(x[train], y[train], 16.0, (0.0,), (1.0,)),
                Images(x[test], y[test], 16.0, (0.0,), (1.0,)), 10)


def load(data_dir: str, download: bool = False, seed: int = 0, *, url: str = CIFAR_URL,
         md5sum: str = CIFAR_MD5) -> Data:
    """CIFAR-10 when it is in ``data_dir`` (or, with ``download``, can be fetched), otherwise scikit-learn's digits.

    Every rank calls it. With ``download``, the first rank on each machine fetches and unpacks
    (``data_dir`` is a folder of that machine) while the others wait at a barrier; then every rank reads.

    Example:
        >>> load("data").name
        'scikit-learn digits'
    """
    if download:
        world = autodist.init()
        if world.local_rank == 0 and not cifar10_present(data_dir):
            download_cifar10(data_dir, url=url, md5sum=md5sum)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank reads before the download is complete
    if cifar10_present(data_dir):
        return load_cifar10(data_dir)
    return load_digits(seed)
