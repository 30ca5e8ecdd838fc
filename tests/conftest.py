"""Shared fixtures: a pool of real gloo ranks per world size, kept for the whole session.

The tests are grouped like the package (tests/dp, tests/mp, ...); the shared helpers (workloads, alike, ranks,
the scripts the launch tests run) stay here in tests/. Every folder goes on sys.path before any rank pool is
spawned, so the ranks can unpickle a function of any test module, whichever test started the pool.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE] + sorted(os.path.join(_HERE, d) for d in os.listdir(_HERE)
                                if os.path.isdir(os.path.join(_HERE, d)) and d not in ("outside", "__pycache__"))

from ranks import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


def run_on_ranks(size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(*args) on ``size`` ranks of a reused pool; a broken pool is replaced."""
    pool = _pools.get(size)
    if pool is None or not pool.alive:
        pool = _pools[size] = RankPool(size)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        if not pool.alive:
            _pools.pop(size, None)


@pytest.fixture(scope="session")
def ranks() -> Callable[..., list[Any]]:
    yield run_on_ranks
    for pool in _pools.values():
        pool.close()
    _pools.clear()
