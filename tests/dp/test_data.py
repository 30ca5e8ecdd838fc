"""Sharding: every sample once per epoch, the single-process global batches, clear errors."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import autodist
import workloads as w
from autodist.dp.data import shard, slice_bounds
from autodist.runtime import provenance
from alike import assert_same_training

NO_ORDER = lambda order: pytest.fail("this loader must not need rank 0's order")  # noqa: E731


def test_slice_bounds_cover_everything_once():
    for n in range(0, 12):
        for size in range(1, 5):
            parts = [slice_bounds(n, r, size) for r in range(size)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 1


def test_tensor_and_numpy_shards_are_strided_and_keep_their_kind():
    x, y = torch.arange(10).reshape(5, 2), np.arange(5)
    xs, ys = shard((x, y), 1, 2, NO_ORDER)
    assert isinstance(xs, torch.Tensor) and isinstance(ys, np.ndarray)
    assert xs.tolist() == [[2, 3], [6, 7]] and ys.tolist() == [1, 3]
    assert isinstance(shard([x, y], 0, 2, NO_ORDER), list)
    assert shard(np.arange(5), 0, 2, NO_ORDER).tolist() == [0, 2, 4]


def test_dataset_shard_is_a_strided_subset():
    ds = TensorDataset(torch.arange(7))
    parts = [shard(ds, r, 3, NO_ORDER) for r in range(3)]
    assert [[int(s[0]) for s in p] for p in parts] == [[0, 3, 6], [1, 4], [2, 5]]


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


class _Counting(IterableDataset):
    def __iter__(self):
        yield from range(6)


@pytest.mark.parametrize("data, error, words", [
    ((torch.zeros(4), torch.zeros(5)), ValueError, "different lengths [4, 5]"),
    (torch.zeros(2), ValueError, "2 sample(s) but there are 3"),
    (torch.tensor(1.0), ValueError, "0-dimensional"),
    ({"x": torch.zeros(4)}, TypeError, "cannot shard data of type dict"),
    ([torch.zeros(4), "abc"], TypeError, "data[1] is a str"),
    ((), ValueError, "empty tuple"),
    (_Stream(), TypeError, "IterableDataset"),
    (DataLoader(TensorDataset(torch.zeros(4)), batch_size=None), ValueError, "batch_size=None"),
])
def test_bad_data_gets_a_clear_error(data, error, words):
    with pytest.raises(error) as info:
        shard(data, 0, 3, NO_ORDER)
    assert words in str(info.value)


def _pair_collate(samples):
    xs, ys = zip(*samples)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


@pytest.mark.parametrize("size, n, batch, drop_last", [(2, 21, 4, False), (3, 17, 8, False), (3, 17, 8, True)])
def test_loader_slices_are_the_single_process_batches(size, n, batch, drop_last):
    def make():
        return DataLoader(TensorDataset(torch.arange(n), torch.arange(n) * 10), batch_size=batch, shuffle=True,
                          drop_last=drop_last, collate_fn=_pair_collate, generator=torch.Generator().manual_seed(5))
    single, shards = make(), [shard(make(), r, size, NO_ORDER) for r in range(size)]
    seen_epochs = []
    for _ in range(2):
        expected = [b["x"].tolist() for b in single]
        epoch = list(zip(*[list(s) for s in shards]))  # each rank runs its epoch to the end
        # a rank holding no row of a short last batch gets a stand-in (the batch's first row) that counts 0
        got = [sum((b["x"].tolist() for b in parts if provenance.known_share(b["x"]).count), []) for parts in epoch]
        assert got == expected  # same global batches, same order, each rank's slice in place
        for parts in epoch:
            assert all(set(b) == {"x", "y"} and torch.equal(b["y"], b["x"] * 10) for b in parts)
        seen_epochs.append(sum(got, []))
    assert seen_epochs[0] != seen_epochs[1]  # reshuffled each epoch
    if not drop_last:
        assert sorted(seen_epochs[0]) == list(range(n))  # every sample exactly once
    assert all(len(s) == len(single) for s in shards)


def test_a_rank_with_no_row_gets_the_batchs_first_as_a_stand_in():
    loader = DataLoader(TensorDataset(torch.randn(5, 3), torch.arange(5)), batch_size=4)
    sharded = shard(loader, 2, 3, NO_ORDER)
    last = list(sharded)[-1]  # the last global batch has 1 sample (4): rank 2 holds none of it
    assert last[0].shape == (1, 3) and last[1].tolist() == [4]
    assert provenance.known_share(last[1]).count == 0  # weighted zero


def test_a_stand_in_is_cut_along_the_batch_dimension():
    def time_major(samples):  # (time, batch) batches, as a language model's collate makes them
        return {"tokens": torch.stack([s[0] for s in samples], dim=1), "names": [f"s{int(s[1])}" for s in samples],
                "scale": torch.tensor(2.0)}
    loader = DataLoader(TensorDataset(torch.randn(5, 7), torch.arange(5)), batch_size=4, collate_fn=time_major)
    last = list(shard(loader, 2, 3, NO_ORDER, dim=1))[-1]  # rank 2 holds none of the 1-sample last batch
    assert last["tokens"].shape == (7, 1) and last["names"] == ["s4"] and last["scale"].item() == 2.0


def test_loader_options_are_kept():
    def init_fn(worker_id):
        torch.manual_seed(worker_id)
    loader = DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4, num_workers=2, pin_memory=False,
                        worker_init_fn=init_fn, persistent_workers=True, timeout=30)
    out = shard(loader, 0, 2, NO_ORDER)
    assert (out.num_workers, out.persistent_workers, out.timeout, out.worker_init_fn) == (2, True, 30, init_fn)
    assert [b[0].tolist() for b in out] == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]


class EpochSeeded(torch.utils.data.Sampler):
    """A sampler whose order the epoch picks, as a DistributedSampler's does (set_epoch before each epoch)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def test_set_epoch_on_the_returned_loaders_sampler_is_a_ddp_habit_that_works():
    """DDP scripts call loader.sampler.set_epoch(epoch): on autodist's loader it reaches a sampler that takes the
    epoch, and is harmless otherwise (the loader reshuffles every epoch as the single-process one does)."""
    seeded = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, sampler=EpochSeeded(8))
    out = shard(seeded, 0, 2, NO_ORDER)
    epochs = []
    for epoch in (0, 1, 0):
        out.sampler.set_epoch(epoch)
        epochs.append([b[0].tolist() for b in out])
        seeded.sampler.set_epoch(epoch)
        assert epochs[-1] == [batch[0].tolist()[:2] for batch in seeded]  # rank 0's half of each global batch
    assert epochs[0] == epochs[2] != epochs[1]
    plain = shard(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), 0, 2, NO_ORDER)
    plain.sampler.set_epoch(5)  # nothing to pass it to: accepted
    assert [b[0].tolist() for b in plain] == [[0, 1], [4, 5]]


def test_in_one_process_the_loader_gives_its_own_batches_and_takes_set_epoch():
    """Without a launcher (and under `autodist run -n 1`) parallelize returns a loader that keeps its position
    for checkpoints: its batches are the loader's own, in the same order (its generator or the global RNG),
    it reads as the loader (batch_size, drop_last, len), and set_epoch is accepted or passed on."""
    def loaders(seeded: bool, **options):
        return [DataLoader(TensorDataset(torch.arange(10)), batch_size=4, **options,
                           generator=torch.Generator().manual_seed(0) if seeded else None) for _ in range(2)]

    for seeded, options in ((True, {"shuffle": True}), (False, {"shuffle": True}), (False, {"drop_last": True})):
        loader, reference = loaders(seeded, **options)
        model, kept = autodist.parallelize(torch.nn.Linear(2, 2), loader)
        assert (kept.batch_size, kept.drop_last, len(kept)) == (4, loader.drop_last, len(loader))
        kept.sampler.set_epoch(3)
        for seed in (1, 2):
            torch.manual_seed(seed)
            got = [b[0].tolist() for b in kept]
            torch.manual_seed(seed)
            assert got == [b[0].tolist() for b in reference], options
    seeded = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, sampler=EpochSeeded(8))
    _, kept = autodist.parallelize(torch.nn.Linear(2, 2), seeded)
    kept.sampler.set_epoch(7)
    assert seeded.sampler.epoch == 7  # a sampler's own set_epoch gets the epoch
    stream = DataLoader(_Counting(), batch_size=4)
    _, kept = autodist.parallelize(torch.nn.Linear(2, 2), stream)
    kept.sampler.set_epoch(1)
    batches = list(kept)
    assert [b.tolist() for b in batches] == [b.tolist() for b in stream]

def test_a_global_rng_loader_takes_rank_zeros_order_once_an_epoch():
    calls = []
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, shuffle=True)
    out = shard(loader, 0, 2, lambda order: calls.append(1) or list(order))
    assert calls == [] and loader.batch_sampler.sampler.generator is None  # the user's loader is untouched
    assert len(list(out)) == 2 and len(list(out)) == 2
    assert calls == [1, 1]


def _global_rng_order():
    # only rank 0's global RNG matches the single-process run's; the others' differ
    torch.manual_seed(42 if w.rank() == 0 else 100 + w.rank())
    model = w.mlp()
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=6, shuffle=True)
    _, data = autodist.parallelize(model, loader)
    return [[b[0].tolist() for b in data] for _ in range(2)]


def test_global_rng_shuffle_is_the_single_process_order(ranks):
    torch.manual_seed(42)
    w.mlp()  # the same draws as the ranks make before iterating
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=6, shuffle=True)
    expected = [[b[0].tolist() for b in loader] for _ in range(2)]
    a, b = ranks(2, _global_rng_order)
    merged = [[x + y for x, y in zip(epoch_a, epoch_b)] for epoch_a, epoch_b in zip(a, b)]
    assert merged == expected and expected[0] != expected[1]


def _numpy_run():
    x, y = w.digits_like(21)
    xn, yn = x.numpy(), y.numpy()

    def batches(xs, ys, b):
        return [(torch.from_numpy(xs[i:i + b]), torch.from_numpy(ys[i:i + b])) for i in range(0, len(xs), b)]
    ref = w.train(w.seeded(w.mlp, 0), batches(xn, yn, 6), "sgd", 3)
    model, (xs, ys) = autodist.parallelize(w.seeded(w.mlp, w.rank()), (xn, yn))
    assert isinstance(xs, np.ndarray)
    # local batch 3 on each of 2 ranks = the single-process batch of 6, thanks to strided shards
    return w.state(ref), w.state(w.train(model, batches(xs, ys, 3), "sgd", 3))


def test_numpy_input_matches_one_process(ranks):
    assert_same_training(ranks(2, _numpy_run))


class _Squares(Dataset):
    def __len__(self):
        return 18

    def __getitem__(self, i):
        x = torch.linspace(-1, 1, 6) * (i % 5)
        return x, torch.tensor(i % 3)


def _dataset_run():
    ref = w.train(w.seeded(w.mlp, 0), DataLoader(_Squares(), batch_size=6), "adam", 3)
    model, ds = autodist.parallelize(w.seeded(w.mlp, w.rank()), _Squares())
    return w.state(ref), w.state(w.train(model, DataLoader(ds, batch_size=2), "adam", 3))


def test_dataset_input_matches_one_process(ranks):
    assert_same_training(ranks(3, _dataset_run))


@pytest.mark.parametrize("make_sampler", [
    lambda n: torch.utils.data.SubsetRandomSampler(range(n)),
    lambda n: torch.utils.data.WeightedRandomSampler([1.0] * n, n),
])
def test_every_global_rng_sampler_follows_rank_zeros_order(make_sampler):
    rank0_order = [5, 2, 7, 0, 1, 3, 6, 4]
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, sampler=make_sampler(8))
    shards = [shard(loader, r, 2, lambda order: rank0_order) for r in range(2)]
    torch.manual_seed(0)
    first = [b[0].tolist() for b in shards[0]]
    torch.manual_seed(1)  # another global RNG state: the order must not depend on it
    second = [b[0].tolist() for b in shards[1]]
    assert first == [[5, 2], [1, 3]] and second == [[7, 0], [6, 4]]
    assert loader.batch_sampler.sampler.generator is None


def test_uneven_tensor_shards_are_announced(caplog):
    logger = logging.getLogger("autodist")  # autodist's logger does not propagate once init() configured it
    logger.addHandler(caplog.handler)
    try:
        shard(torch.zeros(5, 2), 0, 2, NO_ORDER)
    finally:
        logger.removeHandler(caplog.handler)
    assert "5 samples, which do not split evenly over 2 ranks" in caplog.text


# -- (time, batch) data: word_language_model's loop ----------------------------------------------------------

def _batchify(ids: torch.Tensor, bsz: int) -> torch.Tensor:
    """word_language_model's batchify: the token stream cut into bsz columns, (time, batch)."""
    n = ids.size(0) // bsz
    return ids[:n * bsz].view(bsz, -1).t().contiguous()


def _train_lm(model, train_data: torch.Tensor, bptt: int = 5, lr: float = 0.5) -> list[float]:
    """word_language_model's train(): time windows of the columns, the hidden state carried (detached) from
    window to window, NLL over every token, clipping, and its hand-written SGD on p.data."""
    hidden = model.init_hidden(train_data.size(1))
    losses = []
    for i in range(0, train_data.size(0) - 1, bptt):
        seq_len = min(bptt, len(train_data) - 1 - i)
        data, targets = train_data[i:i + seq_len], train_data[i + 1:i + 1 + seq_len].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = torch.nn.functional.nll_loss(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses


def _time_batch():
    from outside.word_language_model import RNNModel
    torch.set_default_dtype(torch.float64)
    try:
        ids = torch.randint(0, 30, (8 * 23,), generator=torch.Generator().manual_seed(5))
        train_data = _batchify(ids, 8)  # (23, 8): 23 time steps of 8 columns
        build = lambda: w.seeded(lambda: RNNModel("LSTM", 30, 12, 16, 2, dropout=0.0), 0)  # noqa: E731
        reference = build()
        _train_lm(reference, train_data)
        model, mine = autodist.parallelize(build(), train_data, batch_dim=1)
        _train_lm(model, mine)
        return w.state(reference), w.state(model), tuple(mine.shape)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("n", [2, 3])
def test_time_batch_language_model_data_is_split_by_columns_and_trains_as_one_process(ranks, n):
    """parallelize(model, train_data, batch_dim=1): each rank keeps columns r, r+n, ... of every time step
    (8 columns: 4 + 4, or 3 + 3 + 2), slices the same time windows, and the training is one process's."""
    for rank, (ref, got, shape) in enumerate(ranks(n, _time_batch)):
        assert shape == (23, len(range(rank, 8, n)))
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _time_batch_left_at_default():
    """word_language_model converted without batch_dim: (time, batch) data would be split along the time."""
    from outside.word_language_model import RNNModel
    ids = torch.randint(0, 30, (8 * 23,), generator=torch.Generator().manual_seed(5))
    model, mine = autodist.parallelize(w.seeded(lambda: RNNModel("LSTM", 30, 12, 16, 2, dropout=0.0), 0),
                                       _batchify(ids, 8))
    try:
        _train_lm(model, mine)
    except ValueError as e:
        return str(e)
    return "no error"


def test_time_batch_data_left_at_the_default_batch_dim_raises_naming_batch_dim_1(ranks):
    """The silent case of word_language_model: the default batch_dim splits the time; the LSTM (batch_first=
    False) sees all 8 columns while autodist counts 5 time steps as samples: the first forward raises on every
    rank, naming batch_dim=1 (and batch_dim=0 to insist)."""
    for message in ranks(2, _time_batch_left_at_default):
        assert message.startswith("autodist counts this forward as 5 samples, along dimension 0 of the data "
                                  "(batch_dim=0: parallelize splits tensors passed as data along it"), message
        assert "the model's LSTM 'rnn' (batch_first=False) batches along dimension 1 of its input and sees a batch " \
               "of 8" in message and "parallelize(model, data, batch_dim=1)" in message, message
        assert message.endswith("pass batch_dim=0 explicitly to say so"), message


class _SeqFirst(torch.nn.Module):
    """A (seq, batch) model: an LSTM and an nn.TransformerEncoder, both with batch_first=False."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(30, 8)
        self.rnn = torch.nn.LSTM(8, 8, batch_first=batch_first)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 30)

    def forward(self, x):
        return self.head(self.encoder(self.rnn(self.embed(x))[0]))


def _layouts_that_agree():
    """Loops whose batch is where autodist counts it: no error, every step trained."""
    ids = torch.randint(0, 30, (24, 6), generator=torch.Generator().manual_seed(1))  # 24 sequences of 6 tokens
    steps = 0
    # (N, T) data, transposed to (T, b) in the loop for a seq-first model: split along the samples, counted right
    model, mine = autodist.parallelize(w.seeded(_SeqFirst, 0), ids)
    for i in range(0, len(mine), 4):
        model(mine[i:i + 4].t()).sum().backward()
        steps += 1
    # a DataLoader of sequences collated (T, b) for a seq-first model: its batches' shares count
    loader = DataLoader(TensorDataset(ids), batch_size=8, collate_fn=lambda b: torch.stack([s[0] for s in b]).t())
    model, loader = autodist.parallelize(w.seeded(_SeqFirst, 0), loader)
    for x in loader:
        model(x).sum().backward()
        steps += 1
    # batch_first=True layers on (N, T) data
    model, mine = autodist.parallelize(w.seeded(lambda: _SeqFirst(batch_first=True), 0), ids)
    model(mine[:4]).sum().backward()
    # (time, batch) data split by columns, and the default insisted on explicitly
    model, mine = autodist.parallelize(w.seeded(_SeqFirst, 0), ids.t().contiguous(), batch_dim=1)
    model(mine[:3]).sum().backward()
    model, mine = autodist.parallelize(w.seeded(_SeqFirst, 0), ids.t().contiguous(), batch_dim=0)
    model(mine[:3]).sum().backward()
    return steps + 3


def test_layouts_where_the_batch_is_where_autodist_counts_it_pass_the_check(ranks):
    assert ranks(2, _layouts_that_agree) == [3 + 3 + 3] * 2


def test_batch_dim_beyond_the_datas_dimensions_names_both():
    with pytest.raises(ValueError, match=r"shape \(5,\) but batch_dim=1"):
        shard(torch.arange(5), 0, 2, dim=1)
    with pytest.raises(ValueError, match="different lengths"):
        shard((torch.zeros(4, 6), torch.zeros(4, 5)), 0, 2, dim=1)
