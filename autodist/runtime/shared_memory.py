"""One file of shared memory, made by one rank and mapped by the others of the same machine.

The file lives in ``/dev/shm``, a file system in memory. Its whole size is
reserved when it is made (``posix_fallocate``): a full ``/dev/shm`` (a container
started with the default 64 MB, say) is then an error here, which the caller
turns into "use the backend's all-reduce", rather than a SIGBUS at the first
write into a page that cannot be had. The maker removes the file as soon as
every rank has mapped it, so nothing is left in ``/dev/shm`` when a rank dies
later: the memory goes away with the last mapping. Used by :mod:`autodist.runtime.shared_slots`.

Example:
    >>> path, why = make(1 << 20)             # one rank; the others learn the path
    >>> mapping = map_file(path, 1 << 20)     # every rank, the maker too
    >>> remove(path)                          # the maker, once every rank said it mapped the file
    >>> slot = torch.frombuffer(mapping, dtype=torch.float32, count=1024, offset=0)
"""
from __future__ import annotations

import mmap
import os
import secrets

DIRECTORY = "/dev/shm"
ALIGN = 64  # bytes: every region starts on a cache line


def available() -> bool:
    """Whether this machine has a ``/dev/shm`` (Linux does; macOS does not)."""
    return os.path.isdir(DIRECTORY)


def free_bytes() -> int:
    """Bytes that can still be allocated in ``/dev/shm``; 0 where there is none (not Linux)."""
    try:
        stats = os.statvfs(DIRECTORY)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def memory_headroom() -> int | None:
    """Bytes of memory that may still be taken: the machine's available memory, and a container's limit
    (cgroup v2) less what it uses where there is one; None where neither can be read."""
    values = []
    try:
        with open("/proc/meminfo") as f:
            values += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                values.append(int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return min(values) if values else None


def make(nbytes: int) -> tuple[str | None, str]:
    """A new file of ``nbytes`` reserved bytes: its path, or None and why not.

    At most half of what ``/dev/shm`` has free is taken, so that the data
    loaders' workers (which share their batches through it) keep room, and at
    most half of the memory still available (the file's pages are memory, and
    ``/dev/shm``'s size is only a ceiling: a container may allow less).
    """
    free = free_bytes()
    if 2 * nbytes > free:
        return None, (f"the buckets need {nbytes / 2**20:.1f} MiB of {DIRECTORY} and it has "
                      f"{free / 2**20:.1f} MiB free (half of it at most is used; a container's is 64 MB "
                      f"unless started with a larger --shm-size)")
    headroom = memory_headroom()
    if headroom is not None and 2 * nbytes > headroom:
        return None, (f"the buckets need {nbytes / 2**20:.1f} MiB of shared memory and only "
                      f"{headroom / 2**20:.1f} MiB of memory are available (half of it at most is used)")
    path = os.path.join(DIRECTORY, f"autodist-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        return None, f"cannot make a file in {DIRECTORY}: {e}"
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        remove(path)
        return None, f"cannot reserve {nbytes / 2**20:.1f} MiB in {DIRECTORY}: {e}"
    os.close(fd)
    return path, ""


def map_file(path: str, nbytes: int) -> mmap.mmap:
    """Map the file another rank made (raises OSError where it cannot be opened: another machine's)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {nbytes}: not the file made for "
                          f"these ranks")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of cache lines."""
    return -(-nbytes // ALIGN) * ALIGN
