"""Run a function on N real gloo ranks, reusing the processes across tests.

Starting a process that imports torch is the expensive part, so a pool of N
ranks starts once (file rendezvous, never a fixed port), joins one process
group, and then runs one test function after another. A failing rank's
traceback is returned to the test; a rank that hangs past the timeout gets the
whole pool killed (it is rebuilt for the next test).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable

_CTX = mp.get_context("spawn")


def _worker(rank: int, size: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


class RankPool:
    """N processes joined in one gloo process group, ready to run test functions."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix="autodist-ranks-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._tasks = [_CTX.Queue() for _ in range(size)]
        self._results = _CTX.Queue()
        self._procs = [_CTX.Process(target=_worker, args=(r, size, init_file, self._tasks[r], self._results),
                                    daemon=True) for r in range(size)]
        # glibc gives each new thread a malloc arena of its own up to 8 per core, read at process start: a rank
        # that starts threads (a parameter server's, one per model) would grow its resident memory by a few MB
        # a thread until that cap, depending on what the pool ran before. Two arenas: what grows is what is
        # held (tests/test_memory.py measures it).
        before = os.environ.get("MALLOC_ARENA_MAX")
        os.environ["MALLOC_ARENA_MAX"] = "2"
        try:
            for p in self._procs:
                p.start()
        finally:
            if before is None:
                del os.environ["MALLOC_ARENA_MAX"]
            else:
                os.environ["MALLOC_ARENA_MAX"] = before

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        """fn(*args) on every rank; returns the per-rank results, or raises with their tracebacks.

        fn must be importable (a module-level function) since the ranks are spawned.
        """
        for q in self._tasks:
            q.put((fn, args))
        results: dict[int, tuple[bool, Any]] = {}
        wait = timeout
        while len(results) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=wait)
            except queue.Empty:
                break
            results[rank] = (ok, value)
            if not ok:
                wait = 10.0  # the others may be stuck in a collective with the failed rank
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        missing = [r for r in range(self.size) if r not in results]
        if failed or missing:
            self.close(kill=True)
            lines = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failed.items())]
            if missing:
                lines.append(f"--- ranks {missing} did not finish within the time limit (hung?)")
            raise RankFailure("\n".join(lines))
        return [results[r][1] for r in range(self.size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()
