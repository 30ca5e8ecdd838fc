"""A checkpoint carries where the loop stands in its data: a run stopped at step 37 and resumed, at the same or
another number of ranks, takes the same samples from step 38 on as one uninterrupted process, and ends with its
weights (float64). Map-style loaders (shuffled by the global RNG, or by a generator of their own), streams, and
Hugging Face datasets (map-style and streaming=True)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

import autodist

SAMPLES, BATCH, STOP, EPOCHS = 1003, 16, 37, 2  # 63 global batches an epoch: step 37 is inside the first


class Ids(IterableDataset):
    """A stream of (features, target, id), split among the loader's workers by get_worker_info()."""

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        x, y = _data()
        for i in range(first, SAMPLES, step):
            yield x[i], y[i], i


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64)
    return x, x @ torch.arange(1.0, 5.0, dtype=torch.float64) + 0.1 * torch.randn(SAMPLES, generator=g,
                                                                                   dtype=torch.float64)


def _hugging_face(streaming: bool):
    """The same samples as a Hugging Face dataset: map-style, or streamed from a JSON-lines file with
    ``load_dataset(..., streaming=True)`` (a local file: nothing downloaded)."""
    import datasets

    x, y = _data()
    rows = {"x": x.tolist(), "y": y.tolist(), "id": list(range(SAMPLES))}
    if not streaming:
        return datasets.Dataset.from_dict(rows).with_format("torch", dtype=torch.float64)
    path = os.path.join(tempfile.gettempdir(), f"autodist-ids-{SAMPLES}.jsonl")
    if not os.path.exists(path):  # written whole, then renamed: ranks may make it at once
        part = f"{path}.{os.getpid()}"
        with open(part, "w") as f:
            f.writelines(json.dumps({k: v[i] for k, v in rows.items()}) + "\n" for i in range(SAMPLES))
        os.replace(part, path)
    stream = datasets.load_dataset("json", data_files=path, split="train", streaming=True)
    return stream.with_format("torch")


def _loader(kind: str) -> DataLoader:
    if kind == "hf-map":
        return DataLoader(_hugging_face(False), batch_size=BATCH, shuffle=True)
    if kind == "hf-stream":
        return DataLoader(_hugging_face(True), batch_size=BATCH)
    if kind == "stream":
        return DataLoader(Ids(), batch_size=BATCH)
    if kind == "stream-workers":
        return DataLoader(Ids(), batch_size=BATCH, num_workers=2)
    x, y = _data()
    dataset = TensorDataset(x, y, torch.arange(SAMPLES))
    if kind == "own-generator":
        return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    return DataLoader(dataset, batch_size=BATCH, shuffle=True)  # the global RNG draws each epoch's order


def _train(kind: str, path: str | None, stop: int | None, compiled: bool = False
           ) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Train EPOCHS epochs from a checkpoint at ``path`` if there is one (saving it at step STOP, and stopping
    there if ``stop``); the weights and the ids of every step taken. In a world of one: the single process.
    ``compiled``: the model torch.compile returns is the one trained, saved and resumed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    model, loader = autodist.parallelize(model, _loader(kind))
    if compiled:
        model = torch.compile(model, backend="eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"epoch": 0, "step": 0}
    if path is not None:
        state = autodist.resume(path, model, optimizer, **state)
    step, seen = state["step"], []
    for epoch in range(state["epoch"], EPOCHS):
        for batch in loader:
            x, y, ids = (batch["x"], batch["y"], batch["id"]) if isinstance(batch, dict) else batch
            x, y = x.double(), y.double()  # (a JSON stream's floats come as float32)
            optimizer.zero_grad()
            noise = 1 + 0.01 * torch.rand((), dtype=torch.float64)  # the global RNG goes on as uninterrupted
            (((model(x).squeeze(1) - y) ** 2).mean() * noise).backward()
            optimizer.step()
            step += 1
            seen.append(ids.tolist())
            if path is not None and step == STOP and stop:
                autodist.save(path, model, optimizer, epoch=epoch, step=step)
                return {}, seen
    return {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model.state_dict().items()}, seen


def _joined(per_rank: list[list[list[int]]]) -> list[list[int]]:
    return [sum((rank[k] for rank in per_rank), []) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("kind, before, after", [
    pytest.param("global-rng", 2, 2, marks=pytest.mark.slow), ("global-rng", 2, 3), ("own-generator", 3, 2), ("stream", 2, 3), ("hf-map", 2, 3),
    ("hf-stream", 3, 2)])
def test_resumed_at_step_37_trains_as_one_uninterrupted_process(ranks, tmp_path, kind, before, after):
    weights, steps = _train(kind, None, None)  # one process, never stopped
    path = os.fspath(tmp_path / "ckpt.pt")
    first = ranks(before, _train, kind, path, True)
    assert _joined([ids for _, ids in first]) == steps[:STOP]
    second = ranks(after, _train, kind, path, False)
    assert _joined([ids for _, ids in second]) == steps[STOP:]  # step 38 on: the same samples, none again
    for got, _ in second:
        torch.testing.assert_close(got, weights, rtol=0, atol=1e-10)


def _in(ranks, world: int, *args):
    """``_train(*args)`` at ``world`` ranks; a world of one is this process, run as plain ``python`` runs it."""
    return [_train(*args)] if world == 1 else ranks(world, _train, *args)


@pytest.mark.parametrize("kind, before, after", [("global-rng", 1, 1), ("stream", 2, 1), ("own-generator", 1, 2)])
def test_a_world_of_one_saves_and_resumes_its_position_as_more_ranks_do(ranks, tmp_path, kind, before, after):
    """Plain `python` (no launcher) keeps the loader's position too: stopped at step 37 and resumed, in one
    process or from and to more ranks, the samples from step 38 on and the weights are one uninterrupted run's."""
    weights, steps = _train(kind, None, None)
    path = os.fspath(tmp_path / "ckpt.pt")
    first = _in(ranks, before, kind, path, True)
    assert _joined([ids for _, ids in first]) == steps[:STOP]
    second = _in(ranks, after, kind, path, False)
    assert _joined([ids for _, ids in second]) == steps[STOP:]
    for got, _ in second:
        torch.testing.assert_close(got, weights, rtol=0, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("compiled_first", [True, False], ids=["compiled-then-not", "not-then-compiled"])
def test_a_compiled_model_saves_and_resumes_as_the_model_it_wraps(ranks, tmp_path, compiled_first):
    """autodist.save(path, torch.compile(model), ...) as scripts write it: the file names the tensors as the
    uncompiled model does and holds the loader's position (before: '_orig_mod.' keys, no position, so a
    compiled run restarted re-read its epoch from the first batch and an uncompiled one could not load it)."""
    weights, steps = _train("own-generator", None, None)  # one process, never stopped
    path = os.fspath(tmp_path / "ckpt.pt")
    first = ranks(2, _train, "own-generator", path, True, compiled_first)
    assert _joined([ids for _, ids in first]) == steps[:STOP]
    saved = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in k for k in saved["model"]), list(saved["model"])
    second = ranks(2, _train, "own-generator", path, False, not compiled_first)
    assert _joined([ids for _, ids in second]) == steps[STOP:]
    for got, _ in second:
        assert max(float((got[k] - weights[k]).abs().max()) for k in weights) <= 1e-10


LAUNCHED = '''
import sys
import tempfile
import torch
import autodist
sys.path.insert(0, sys.argv[1])
from test_resume_data import _train
weights, seen = _train("stream-workers", sys.argv[2], sys.argv[3] == "stop")
torch.save({"weights": weights, "seen": seen}, f"rank{autodist.init().rank}.pt")
'''


@pytest.mark.slow
def test_a_stream_read_by_loader_workers_resumes_as_one_process(tmp_path):
    """Loader workers start only under a launcher (the test's ranks are daemons): 3 ranks stop, 2 resume."""
    weights, steps = _train("stream-workers", None, None)
    script, path = tmp_path / "resumed.py", os.fspath(tmp_path / "ckpt.pt")
    script.write_text(LAUNCHED)
    for size, stop in ((3, "stop"), (2, "go")):
        proc = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", str(size), str(script),
                               os.path.dirname(__file__), path, stop],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(size)]
        assert _joined([run["seen"] for run in runs]) == (steps[:STOP] if stop == "stop" else steps[STOP:])
    for run in runs:
        torch.testing.assert_close(run["weights"], weights)


def _saved_between_epochs(path: str) -> int:
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _loader("global-rng"))
    for _ in loader:
        pass
    autodist.save(path, model)
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _loader("global-rng"))
    autodist.load(path, model)
    return loader.position.epoch


def test_a_checkpoint_after_an_epoch_begins_the_next_afresh(ranks, tmp_path):
    path = os.fspath(tmp_path / "ckpt.pt")
    assert ranks(2, _saved_between_epochs, path) == [0, 0]  # epoch 0 ended: the next to begin is 1
    assert torch.load(path, weights_only=True)["loaders"] == [{"epoch": 1, "taken": 0, "rng": None, "generators": []}]


def _saved_before_the_first_batch(path: str) -> list[list[int]]:
    """Saved once the epoch began (its order and worker seed drawn) and before its first batch: resumed there."""
    torch.manual_seed(0)
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _loader("global-rng"))
    batches = iter(loader)
    autodist.save(path, model)
    del batches
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _loader("global-rng"))
    autodist.load(path, model)
    return [ids.tolist() for _, _, ids in loader]


def test_a_checkpoint_in_an_epoch_before_its_first_batch_resumes_that_epoch(ranks, tmp_path):
    torch.manual_seed(0)
    torch.nn.Linear(4, 1)  # the single process draws as the ranks do before their loop
    expected = [ids.tolist() for _, _, ids in _loader("global-rng")]
    per_rank = ranks(2, _saved_before_the_first_batch, os.fspath(tmp_path / "ckpt.pt"))
    assert _joined(per_rank) == expected


def _resumed_without_the_loader(path: str) -> list[str]:
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _loader("global-rng"))
    for step, _ in enumerate(loader):
        if step == 4:
            break
    autodist.save(path, model)
    model = autodist.parallelize(torch.nn.Linear(4, 1).double())[0]
    return autodist.load(path, model)


def test_a_position_with_no_loader_to_take_it_is_named(ranks, tmp_path, caplog):
    path = os.fspath(tmp_path / "ckpt.pt")
    ranks(2, _resumed_without_the_loader, path)
    model = torch.nn.Linear(4, 1).double()
    with caplog.at_level("WARNING", logger="autodist"):
        autodist.load(path, model)  # in one process: parallelize splits no loader to give it to
    assert "epoch 0 after 5 batches" in caplog.text and "restarts its epoch" in caplog.text


def _ids_of_a_hugging_face_dataset() -> list[int]:
    model, dataset = autodist.parallelize(torch.nn.Linear(4, 1).double(), _hugging_face(False))
    return [int(i) for i in dataset["id"]]


def test_a_hugging_face_dataset_is_split_by_its_own_shard_and_stays_one(ranks):
    import datasets

    assert isinstance(autodist.parallelize(torch.nn.Linear(4, 1), _hugging_face(False))[1], datasets.Dataset)
    assert ranks(3, _ids_of_a_hugging_face_dataset) == [list(range(r, SAMPLES, 3)) for r in range(3)]  # strided


# -- a resume checks the data it passes over ------------------------------------------------------------------

class PerRunOrder(torch.utils.data.Sampler):
    """A shuffle drawn from a generator the sampler makes itself, seeded per run (as from the time): the
    checkpoint cannot carry it."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed)).tolist())

    def __len__(self) -> int:
        return self.n


class Shards(IterableDataset):
    """A stream over files read in the order given: (features, target, id)."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):
        x, y = _data()
        for shard in self.order:
            for i in range(shard * 100, min(SAMPLES, shard * 100 + 100)):
                yield x[i], y[i], i


def _changed(variant: str, saving: bool) -> DataLoader:
    """The loader of the run that saves (``saving``) and of the one that resumes, whose data ``variant`` changed."""
    x, y = _data()
    if variant == "appended":  # samples added at the end of a map-style dataset
        n = SAMPLES if saving else SAMPLES + 16
        x, y = torch.cat([x, x[:16]])[:n], torch.cat([y, y[:16]])[:n]
        return DataLoader(TensorDataset(x, y, torch.arange(n)), batch_size=BATCH, shuffle=True)
    if variant == "per-run-seed":
        return DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=BATCH,
                          sampler=PerRunOrder(SAMPLES, 1 if saving else 2))
    if variant == "reordered":  # a stream's files listed in another order
        return DataLoader(Shards(list(range(11)) if saving else [1, 0, *range(2, 11)]), batch_size=BATCH)
    if variant == "shorter":  # a stream that lost most of its files
        return DataLoader(Shards(list(range(11)) if saving else [0]), batch_size=BATCH)
    return DataLoader(Shards(list(range(11))), batch_size=BATCH)  # "same"


def _resumed_on_changed_data(variant: str, path: str, saving: bool) -> str | list[list[int]]:
    """Stopped at step STOP and saved; or resumed on the changed data: the ids of the steps it took, or the
    error it raised."""
    model, loader = autodist.parallelize(torch.nn.Linear(4, 1).double(), _changed(variant, saving))
    if not saving:
        autodist.load(path, model)
    seen = []
    try:
        for step, (x, y, ids) in enumerate(loader, 1):
            seen.append(ids.tolist())
            if saving and step == STOP:
                autodist.save(path, model)
                break
    except RuntimeError as error:
        return str(error)
    return seen


@pytest.mark.parametrize("variant, said", [
    ("appended", "its dataset held 1003 samples when the checkpoint was saved and holds 1019 now"),
    pytest.param("per-run-seed", "its first 37 batches read again are not the ones the checkpoint's run took",
                 marks=pytest.mark.slow),
    ("reordered", "its first 37 batches read again are not the ones the checkpoint's run took"),
    pytest.param("shorter", "it has 7 batches now, and the checkpoint was saved after 37", marks=pytest.mark.slow)])
def test_a_resume_on_changed_data_names_what_changed(ranks, tmp_path, variant, said):
    """Before: the resumed run passed over 37 batches of whatever the data had become and went on silently
    elsewhere than the run that saved. Saved at 2 ranks, resumed at 3."""
    path = os.fspath(tmp_path / "ckpt.pt")
    ranks(2, _resumed_on_changed_data, variant, path, True)
    for got in ranks(3, _resumed_on_changed_data, variant, path, False):
        assert isinstance(got, str) and said in got and "AUTODIST_RESUME_ANY_DATA=1" in got, got


def _resumed_anyway(path: str) -> tuple[list[list[int]], list[list[int]]]:
    os.environ["AUTODIST_RESUME_ANY_DATA"] = "1"
    try:
        return _resumed_on_changed_data("reordered", path, False), _resumed_on_changed_data("same", path, False)
    finally:
        del os.environ["AUTODIST_RESUME_ANY_DATA"]


def test_resume_any_data_goes_on_from_the_same_batch_number_and_says_so(ranks, tmp_path, caplog):
    path = os.fspath(tmp_path / "ckpt.pt")
    _resumed_on_changed_data("same", path, True)  # one process saves
    with caplog.at_level("WARNING", logger="autodist"):
        reordered, same = _resumed_anyway(path)
    said = [r.getMessage() for r in caplog.records if "AUTODIST_RESUME_ANY_DATA=1 asks" in r.getMessage()]
    assert len(said) == 1 and "are not the ones the checkpoint's run took" in said[0], said  # the same: no word
    changed_ids = [ids.tolist() for _, _, ids in _changed("reordered", False)]
    assert reordered == changed_ids[STOP:]  # batch 38 on of the data as it is now
    assert same == [ids.tolist() for _, _, ids in _changed("same", False)][STOP:]
    on_ranks = ranks(2, _resumed_anyway, path)
    assert _joined([r for r, _ in on_ranks]) == changed_ids[STOP:] and _joined([s for _, s in on_ranks]) == same
