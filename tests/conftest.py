"""Shared fixtures: a pool of real gloo ranks per world size, kept for the whole session (Pools).

The tests are grouped like the package (tests/dp, tests/mp, ...); the shared helpers (workloads, alike, ranks,
the scripts the launch tests run) stay here in tests/. Every folder goes on sys.path before any rank pool is
spawned, so the ranks can unpickle a function of any test module, whichever test started the pool.

The docs pages (tests/test_docs.py) start running with the session, beside the other tests, and their tests
come last.
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


class Pools:
    """Rank pools by world size, started when first asked for and reused: ``pools(size, fn, *args)`` runs
    ``fn(*args)`` on ``size`` ranks; a broken pool is replaced."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def __call__(self, size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        pool = self.pools.get(size)
        if pool is None or not pool.alive:
            pool = self.pools[size] = RankPool(size)
        try:
            return pool.run(fn, *args, timeout=timeout)
        finally:
            if not pool.alive:
                self.pools.pop(size, None)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


@pytest.fixture(scope="session")
def ranks() -> Callable[..., list[Any]]:
    """The session's rank pools: ``ranks(2, fn, arg)`` runs ``fn(arg)`` on 2 ranks and returns their results."""
    pools = Pools()
    yield pools
    pools.close()


def _runs_a_page(item: pytest.Item) -> bool:
    return getattr(item, "originalname", "") == getattr(getattr(item, "module", None), "PAGE_TEST", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The docs pages' tests last: their pages have run beside the other tests by then (docs_pages)."""
    items.sort(key=_runs_a_page)  # stable: the order is otherwise pytest's


@pytest.fixture(scope="session", autouse=True)
def docs_pages(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The selected docs pages, started with the session (tests/test_docs.py, Pages); None if none is."""
    items = [item for item in request.session.items if _runs_a_page(item)]
    if not items:
        yield None
        return
    pages = items[0].module.Pages([item.callspec.params["page"] for item in items], tmp_path_factory)
    try:
        yield pages
    finally:
        pages.close()
