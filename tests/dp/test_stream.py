"""A DataLoader over a stream (an IterableDataset): every global step holds exactly what the single-process
loader's batch k holds, split over the ranks without padding; the uneven tail weighted exactly."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import autodist
import workloads as w
from autodist.dp.data import slice_bounds
from autodist.dp.stream import batch_size, mark, rows

SAMPLES, BATCH = 1003, 16  # a prime: the last global batch holds 11


class Ids(IterableDataset):
    """Sample ids 0..n-1 as a stream, split among the loader's workers by get_worker_info() (torch's pattern)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, step):
            yield torch.tensor([float(i)], dtype=torch.float64), i


def _ids_seen() -> list[list[int]]:
    model, loader = autodist.parallelize(torch.nn.Linear(1, 1).double(), DataLoader(Ids(SAMPLES), batch_size=BATCH))
    seen = []
    for x, ids in loader:
        seen.append(ids.tolist())
        model(x).sum().backward()
    return seen


def _ids_from_a_generator() -> list[list[int]]:
    batches = (batch for batch in DataLoader(Ids(SAMPLES), batch_size=BATCH))  # what some loops pass
    model, loader = autodist.parallelize(torch.nn.Linear(1, 1).double(), batches)
    seen = []
    for x, ids in loader:
        seen.append(ids.tolist())
        model(x).sum().backward()
    return seen


def test_a_generator_of_batches_is_split_the_same_way(ranks):
    expected = [ids.tolist() for _, ids in DataLoader(Ids(SAMPLES), batch_size=BATCH)]
    assert _joined(ranks(2, _ids_from_a_generator)) == expected


def _joined(per_rank: list[list[list[int]]]) -> list[list[int]]:
    return [sum((rank[k] for rank in per_rank), []) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_step_holds_the_single_process_batch(ranks, size):
    per_rank = ranks(size, _ids_seen)
    expected = [ids.tolist() for _, ids in DataLoader(Ids(SAMPLES), batch_size=BATCH)]
    assert _joined(per_rank) == expected  # same samples, same order, the 11-sample tail included, none padded
    assert [len(rank[-1]) for rank in per_rank] == {2: [6, 5], 3: [4, 4, 3], 4: [3, 3, 3, 2]}[size]


def _tail_gradient() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of the last global batch (11 samples) on each rank, and one process's, float64."""
    def build():
        return torch.nn.Linear(1, 1).double()

    model, loader = autodist.parallelize(w.seeded(build, 0), DataLoader(Ids(SAMPLES), batch_size=BATCH))
    for x, ids in loader:
        model.zero_grad()
        ((model(x).squeeze(1) - ids.double()) ** 2).mean().backward()
    ref = w.seeded(build, 0)
    x, ids = list(DataLoader(Ids(SAMPLES), batch_size=BATCH))[-1]
    ((ref(x).squeeze(1) - ids.double()) ** 2).mean().backward()
    n = torch.distributed.get_world_size()
    parts = [slice(*slice_bounds(len(ids), r, n)) for r in range(n)]
    mean_of_means = sum(torch.autograd.grad(((ref(x[p]).squeeze(1) - ids[p].double()) ** 2).mean(),
                                            ref.weight)[0] for p in parts) / n
    return model.weight.grad, ref.weight.grad, mean_of_means


def test_the_uneven_tail_is_weighted_as_one_process(ranks):
    for grad, ref, mean_of_means in ranks(3, _tail_gradient):
        torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(mean_of_means, ref, rtol=1e-9, atol=0)  # the test tells a plain mean apart


class Endless(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(64, generator=g), torch.randint(0, 4, (), generator=g)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _endless() -> tuple[int, int]:
    model, loader = autodist.parallelize(torch.nn.Linear(64, 4), DataLoader(Endless(), batch_size=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    at = {}
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step in (20, 200):
            at[step] = _resident()
        if step == 200:
            break
    return at[20], at[200]


def test_an_endless_stream_trains_in_flat_memory(ranks):
    for at_20, at_200 in ranks(2, _endless):
        assert at_200 - at_20 < 16 << 20, (at_20, at_200)  # nothing of the stream is kept


class Unseeded(IterableDataset):
    """A shuffle without a seed: each process draws its own order."""

    def __iter__(self):
        for i in torch.randperm(64).tolist():
            yield torch.tensor([float(i)])


def _unseeded() -> str:
    torch.manual_seed(1000 + torch.distributed.get_rank())  # as unseeded processes would differ
    model, loader = autodist.parallelize(torch.nn.Linear(1, 1), DataLoader(Unseeded(), batch_size=8))
    try:
        for x in loader:
            model(x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_a_stream_that_differs_between_ranks_fails_naming_the_cause(ranks):
    for message in ranks(2, _unseeded):
        assert "not on the same global batch" in message and "a shuffle buffer without a seed" in message


def test_rows_keep_the_batch_structure():
    from dataclasses import dataclass

    @dataclass
    class Batch:
        ids: torch.Tensor
        names: list

    batch = {"x": torch.arange(10).view(5, 2), "pair": (torch.arange(5), ["a", "b", "c", "d", "e"]),
             "data": Batch(torch.arange(5), ["v", "w", "x", "y", "z"])}
    part = rows(batch, 1, 3)
    assert part["x"].tolist() == [[2, 3], [4, 5]] and part["pair"][0].tolist() == [1, 2]
    assert part["pair"][1] == ["b", "c"] and part["data"].ids.tolist() == [1, 2] and part["data"].names == ["w", "x"]


def test_a_list_of_values_that_is_not_one_a_sample_is_refused_not_cut():
    batch = {"x": torch.zeros(6, 2), "sizes": [3, 4]}  # a per-batch list: cutting it by rows would be a guess
    with pytest.raises(ValueError, match="list of 2 plain values beside 6 samples"):
        rows(batch, 0, 3, n=batch_size(batch))
    assert rows({"x": torch.zeros(6, 2), "names": list("abcdef")}, 0, 3, n=6)["names"] == ["a", "b", "c"]


def test_a_mapping_batch_and_a_scalar_in_it_are_split_and_marked():
    from collections import UserDict  # Hugging Face's BatchEncoding is one

    batch = UserDict({"input_ids": torch.arange(12).view(6, 2), "step": torch.tensor(3)})
    assert batch_size(batch) == 6  # the 0-dim tensor holds no rows
    part = rows(batch, 4, 6)
    assert isinstance(part, UserDict) and part["input_ids"].tolist() == [[8, 9], [10, 11]] and part["step"] == 3
    assert mark(batch) == mark(UserDict({k: v.clone() for k, v in batch.items()})) != mark(part)


WORKERS_SCRIPT = textwrap.dedent('''
    import json
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    import autodist
''') + inspect.getsource(Ids) + textwrap.dedent('''
    model, loader = autodist.parallelize(torch.nn.Linear(1, 1).double(),
                                         DataLoader(Ids(1003), batch_size=16, num_workers=2))
    seen = []
    for x, ids in loader:
        seen.append(ids.tolist())
        model(x).sum().backward()
    with open(f"seen{autodist.init().rank}.json", "w") as f:   # (two ranks' long lines would interleave on stdout)
        json.dump(seen, f)
''')


@pytest.mark.slow
def test_loader_workers_give_the_single_process_batches(tmp_path):
    script = tmp_path / "stream_workers.py"
    script.write_text(WORKERS_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", "--raw-output", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    per_rank = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    expected = [ids.tolist() for _, ids in DataLoader(Ids(SAMPLES), batch_size=BATCH, num_workers=2)]
    assert _joined(per_rank) == expected
