"""torch.compile on a parallelized model: dynamo reports no graph break in any mode (data parallel compiled
after or before parallelize, mp=2, hybrid, sharded, the low-communication modes), and the training is the
uncompiled one: the single-process run for the exact modes, autodist's own uncompiled run for the others."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w

pytestmark = pytest.mark.slow  # torch.compile takes seconds a model: the full tier


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _options(mode: str) -> dict:
    return {"backward": {}, "mp2": {"mp": 2}, "shard-gradients": {"shard": "gradients"},
            "localsgd": {"sync": autodist.LocalSGD(every=2)}, "diloco": {"sync": autodist.DiLoCo(every=2)},
            "gossip": {"sync": autodist.Gossip()},
            "hierarchical": {"sync": autodist.Hierarchical(ranks_per_host=1, across=autodist.LocalSGD(every=2))}
            }[mode]


def _train(model, loader, parallel: bool = True) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    state = autodist.gather_state_dict(model, all_ranks=True) if parallel else w.state(model)  # mp: dense
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


def _compiled(mode: str, order: str):
    """(graph breaks, the compiled parallel run's parameters, the reference's): the reference is one process
    for the exact modes, the same mode uncompiled for the others."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y = w.digits_like(49, features=6, classes=3)  # 12 per global batch: the last one a single row
    exact = mode in ("backward", "mp2", "shard-gradients")
    if exact:
        ref = _train(w.seeded(_build, 0), w.loader(x, y, 12, shuffle=False), parallel=False)
    else:
        plain, plain_loader = autodist.parallelize(w.seeded(_build, 0), w.loader(x, y, 12, shuffle=False),
                                                   **_options(mode))
        ref = _train(plain, plain_loader)
    model = w.seeded(_build, 0)
    if order == "before":
        model = torch.compile(model, backend="aot_eager")
    model, loader = autodist.parallelize(model, w.loader(x, y, 12, shuffle=False), **_options(mode))
    if order == "after":
        model = torch.compile(model, backend="aot_eager")
    par = _train(model, loader)
    return dict(counters["graph_break"]), par, ref, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode, order, size", [("backward", "after", 2), ("backward", "before", 2),
                                               ("mp2", "after", 2), ("mp2", "after", 4),
                                               ("shard-gradients", "after", 2), ("localsgd", "after", 2),
                                               ("diloco", "after", 2), ("gossip", "after", 2),
                                               ("hierarchical", "after", 2), ("localsgd", "before", 2)])
def test_compiled_training_has_no_graph_break_and_trains_as_uncompiled(ranks, mode, order, size):
    for breaks, par, ref, graphs in ranks(size, _compiled, mode, order):
        assert breaks == {}, list(breaks)[:1]
        assert graphs >= 1, graphs  # it did compile
        assert_close(par, ref, rtol=1e-5, atol=1e-6)


def _accumulating(rows: int):
    """Two micro-batches per step under no_sync, the model compiled after parallelize: exact where every
    micro-batch holds the same share; a clear error on every rank where they differ (27 rows: 8, 8 | 8, 3)."""
    x, y = w.digits_like(rows, features=6, classes=3)
    ref = w.seeded(_build, 0)
    model, loader = autodist.parallelize(w.seeded(_build, 0), w.loader(x, y, 8, shuffle=False))
    compiled = torch.compile(model, backend="aot_eager")
    try:
        for m, data in ((ref, w.loader(x, y, 8, shuffle=False)), (compiled, loader)):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            batches = list(iter(data)) if m is ref else data
            pending = []
            for xb, yb in batches:
                pending.append((xb, yb))
                if len(pending) < 2:
                    with autodist.no_sync(m) if m is compiled else contextlib.nullcontext():
                        F.cross_entropy(m(xb), yb).backward()
                    continue
                F.cross_entropy(m(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                pending = []
    except ValueError as e:
        return str(e)
    return w.state(ref), {k.removeprefix("_orig_mod."): v for k, v in w.state(compiled).items()}


def test_accumulation_under_compile_is_exact_or_refused_on_every_rank(ranks):
    for ref, par in ranks(2, _accumulating, 32):
        assert_close(par, ref, rtol=1e-5, atol=1e-6)
    for message in ranks(2, _accumulating, 27):
        assert isinstance(message, str) and "different share" in message and "drop_last=True" in message, message
