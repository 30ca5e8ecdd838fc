"""The file of a checkpoint: its format tag, the CRC-32 checksums, the atomic write and the verified read.

Nothing here knows a model or a process group (:mod:`autodist.train.checkpoint` builds what is saved and
cuts what is loaded); the parameter server writes its own checkpoints through it too. A write goes to a
temporary file beside the final name (flushed and fsynced), is renamed over it, and the directory is fsynced;
a temporary whose writer was killed mid-write is removed by the next save of that checkpoint. A read checks
the format and every checksum, and says in one line what is wrong with a file it refuses.

Example:
    >>> atomic_save(contents(model=state, optimizer=None, extra={}, rng=rng_state()), "ckpt/last.pt")
    >>> read("ckpt/last.pt")["model"]
"""
from __future__ import annotations

import os
import pickle
import random
import re
import secrets
import socket
import time
import zlib
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from autodist.runtime.world import log

_LOADABLE_LEAVES = (type(None), bool, int, float, str, torch.Tensor)
_CHECKSUM = "crc32"  # ~6 GB/s here: a 200 MB checkpoint costs 30 ms to sum; corruption is not an adversary
_ZIP_TAIL = 22 + 65535  # the end-of-directory record and its longest comment
_STALE_AFTER_S = 3600.0  # a temporary whose writer cannot be checked is stale once untouched this long
FORMAT = "autodist.checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: damaged, truncated, or not written by ``autodist.save``."""


def checked_path(path: Any, *, writing: bool) -> str:
    """``path`` as an absolute file name, or a TypeError / ValueError saying what is wrong with it."""
    name = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    if isinstance(name, bytes):
        raise TypeError(f"Expect a str file name for path, bytes {name!r} found; decode it first (os.fsdecode)")
    if name is None:
        raise TypeError(f"Expect a file name (str or os.PathLike) for path, {type(path).__name__} found; "
                        f"e.g. autodist.save('ckpt/last.pt', model, optimizer)")
    if not name:
        raise ValueError("path is empty; give the checkpoint's file name, e.g. 'ckpt/last.pt'")
    full = os.path.abspath(name)
    if name.endswith(("/", os.sep)) or os.path.isdir(full):
        raise ValueError(f"path {name!r} names a directory; give a file in it, e.g. "
                         f"{os.path.join(name, 'last.pt')!r}")
    if writing:
        parent = os.path.dirname(full)
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ValueError(f"cannot write the checkpoint {full!r}: {parent!r} is a file, not a directory; "
                             f"choose another path")
    return full


def check_loadable(value: Any, where: str) -> None:
    """Raise unless ``value`` loads back with ``torch.load(weights_only=True)``."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; a checkpoint needs str or int "
                                f"keys so that it loads with torch.load(weights_only=True)")
            check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]")
    elif not isinstance(value, _LOADABLE_LEAVES):
        raise TypeError(f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) refuses to "
                        f"load; a checkpoint holds numbers, strings, tensors, None, and lists/tuples/dicts of "
                        f"them: convert it first (e.g. pass obj.state_dict() or generator.get_state())")


def rng_state() -> dict[str, Any]:
    """This process's random generators as tensors and plain values (weights_only-loadable)."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": py_gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))


def leaves(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every leaf of a payload with where it sits (``model['0.weight']``), dicts in their (pickled) order."""
    if isinstance(value, dict):
        yield f"{where}:dict{len(value)}", None  # containers count too: an emptied one, a list made a tuple
        for key, item in value.items():
            yield from leaves(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        yield f"{where}:{type(value).__name__}{len(value)}", None
        for i, item in enumerate(value):
            yield from leaves(item, f"{where}[{i}]")
    else:
        yield where, value


def _tensor_crc(tensor: torch.Tensor) -> int:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy())


def _checksums(payload: dict[str, Any]) -> tuple[int, list[tuple[str, int]]]:
    """A CRC-32 of everything but the tensors' bytes, and one per tensor (with where it sits)."""
    structure, tensors = 0, []
    for where, leaf in leaves(payload, ""):
        if isinstance(leaf, torch.Tensor):
            tensors.append((where, _tensor_crc(leaf)))
            text = f"{where}=tensor:{leaf.dtype}:{tuple(leaf.shape)}"
        else:
            text = f"{where}={type(leaf).__name__}:{leaf!r}"
        structure = zlib.crc32(text.encode("utf-8", "surrogatepass") + b"\n", structure)
    return structure, tensors


def contents(model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, extra: dict[str, Any],
             rng: dict[str, Any], sync: dict[str, Any] | None = None,
             loaders: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a checkpoint file holds (the format of :mod:`autodist.train.checkpoint`), its checksums included."""
    payload = {"format": FORMAT, "version": VERSION, "model": model, "optimizer": optimizer, "extra": extra,
               "rng": rng, **({"sync": sync} if sync else {}), **({"loaders": loaders} if loaders else {})}
    return with_checksum(payload)


def with_checksum(payload: dict[str, Any]) -> dict[str, Any]:
    structure, tensors = _checksums(payload)
    return {**payload, "checksum": {"algorithm": _CHECKSUM, "structure": structure,
                                    "tensors": [crc for _, crc in tensors]}}


def _damaged(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint {path!r} is damaged: {what}. The file changed after autodist.save "
                           f"wrote it (a disk, copy or transfer error); resume from an earlier checkpoint, or "
                           f"delete this one to start over")


def _verify(checkpoint: dict[str, Any], path: str) -> None:
    """Recompute the checksums of a loaded checkpoint (its ``checksum`` entry popped) and raise on a mismatch."""
    stored = checkpoint.pop("checksum", None)
    if stored is None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("the checkpoint %s has no checksums (written by an autodist before they were added): "
                        "loaded without verifying it; the next autodist.save writes them", path)
        return
    if not isinstance(stored, dict) or stored.get("algorithm") != _CHECKSUM:
        raise _damaged(path, f"its checksum entry is not a {_CHECKSUM} record ({str(stored)[:60]!r})")
    structure, tensors = _checksums(checkpoint)
    if structure != stored.get("structure") or len(tensors) != len(stored.get("tensors", ())):
        raise _damaged(path, "its names, shapes or numbers do not match the checksum saved with them")
    bad = [where for (where, crc), saved in zip(tensors, stored["tensors"]) if crc != saved]
    if bad:
        raise _damaged(path, f"{len(bad)} of {len(tensors)} tensors do not match the checksums saved with them "
                             f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")


def _machine_id() -> str:
    """8 hex digits naming this machine, boot and PID namespace: where a PID in a temporary's name means
    this process table's PID (a reboot or another container gives another id)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return f"{zlib.crc32('|'.join(parts).encode()):08x}"


_MACHINE = _machine_id()


def _temporary_name(path: str) -> str:
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.{_MACHINE}-{os.getpid()}-{secrets.token_hex(6)}.tmp")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _remove_stale_temporaries(path: str) -> None:
    """Delete the temporaries of ``path`` left by saves that were killed mid-write.

    A temporary from this machine is stale once its writer's PID is gone; one
    from another machine (a shared file system) or without a writer in its
    name (older autodist) once untouched for an hour: a live writer is
    writing to it. A live writer's file is never touched.
    """
    directory, base = os.path.split(path)
    pattern = re.compile(rf"\.{re.escape(base)}\.(?:([0-9a-f]{{8}})-(\d+)-)?[0-9a-f]{{12}}\.tmp")
    removed = []
    for entry in os.scandir(directory):
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        machine, pid = match.group(1), match.group(2)
        try:
            if machine == _MACHINE:
                stale = int(pid) != os.getpid() and not process_alive(int(pid))
            else:
                stale = time.time() - entry.stat().st_mtime > _STALE_AFTER_S
            if stale:
                size = entry.stat().st_size
                os.unlink(entry.path)
                removed.append(f"{entry.name} ({size / 2**20:.1f} MiB)")
        except FileNotFoundError:
            continue  # its writer finished, or another cleaner got there first
    if removed:
        log.warning("removed %d temporary file(s) of %s left by a save that was killed mid-write: %s",
                    len(removed), path, ", ".join(removed))


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (POSIX; elsewhere a directory cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(payload: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename it over ``path``."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(path)  # before writing: a full disk may be full of them
    temporary = _temporary_name(path)
    try:
        with open(temporary, "xb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _why_unreadable(path: str, err: Exception) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, os.fstat(f.fileno()).st_size - _ZIP_TAIL))
        tail = f.read()
    said = (str(err).strip().splitlines() or [""])[0][:160]
    if not head:
        return "the file is empty"
    if head != b"PK\x03\x04":  # torch.save's zip archive
        return "it is not a file written by torch.save or autodist.save (it does not start as a zip archive)"
    if b"PK\x05\x06" not in tail:  # a zip archive ends with its directory
        return "it is truncated (it ends before its zip archive's directory: a write or copy that did not finish)"
    if isinstance(err, pickle.UnpicklingError):
        return ("it holds objects that torch.load(weights_only=True) refuses, so it was not written by "
                "autodist.save, or it is damaged")
    return f"it is damaged ({type(err).__name__}: {said})"


def read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}; write one with autodist.save(path, model, optimizer)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (PermissionError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - torch's many ways of failing on a bad file become one error
        raise CheckpointError(f"cannot read the checkpoint {path!r}: {_why_unreadable(path, err)}. Resume from "
                              f"an earlier checkpoint, or delete this one to start over") from err
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        keys = sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{path!r} is not an autodist checkpoint (expected format {FORMAT!r}, found "
                              f"{keys}); load a plain state dict with model.load_state_dict(torch.load(path))")
    if checkpoint.get("version", 0) > VERSION:
        raise CheckpointError(f"{path!r} has checkpoint format version {checkpoint['version']}, newer than this "
                              f"autodist reads ({VERSION}); upgrade autodist")
    _verify(checkpoint, path)
    return checkpoint
