"""Shared fixtures: a pool of real gloo ranks per world size, kept for the whole session."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
