"""Each rank's gradient is weighted by the samples of the batch its backward went through.

For a loss that is a mean over the batch, the gradient of a global batch of N samples is
sum_r (n_r / N) g_r. These tests pin down where n_r comes from:

A. ``parallelize(model, loader)``: the sharded DataLoader knows n_r and N of every global batch it
   yields, whatever the forward takes: a seq-first GRU/LSTM language model (pytorch/examples'
   word_language_model, in tests/outside/), a dataclass or a UserDict batch.
B. ``parallelize(model, (x, y))``: slices of the strided tensor shards, fed to the model seq-first.
C. forwards with grad enabled that no backward follows (validation, on rank 0 or on every rank) do not
   count.
D. ``parallelize(model)`` with batches sliced by hand: n_r is the size of ``batch_dim`` (default 0) of
   the tensors anywhere in the forward's arguments, or what ``samples=fn`` returns.
E. a count that cannot be inferred raises at the backward (never at a forward no backward follows),
   naming the argument and the fix; ``samples=`` resolves it.
F. accumulation under ``no_sync`` with uneven micro-batches, and ranks with empty slices, stay exact.

Every case trains in one process and in parallel on the same global batches and compares parameters.
A group of cases runs in one call on the ranks (each case's exception is caught there and reported
with its traceback), and the test functions read their case from that call's results.
``test_plain_mean_is_not_the_reference`` shows, in one process, that these cases are sensitive: a
plain mean of the ranks' gradients misses the tolerance, the (n_r / N) weighting meets it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import traceback
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
import workloads as w
from autodist import engine
from autodist.dp.data import slice_bounds
from outside.word_language_model import RNNModel
from alike import assert_same_training

VOCAB, SEQ, WIDTH = 11, 5, 8


# -- models and data -----------------------------------------------------------------------------

def gru() -> nn.Module:
    return RNNModel("GRU", ntoken=VOCAB, ninp=WIDTH, nhid=WIDTH, nlayers=2, dropout=0.0)


def lstm_tied_f64() -> nn.Module:
    return RNNModel("LSTM", ntoken=VOCAB, ninp=WIDTH, nhid=WIDTH, nlayers=1, dropout=0.0, tie_weights=True).double()


def gru_f64() -> nn.Module:
    return gru().double()


class BatchFirst(nn.Module):
    """Control: the same language model called batch-first, which a first-dimension count gets right today."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, hidden: torch.Tensor):
        return self.lm(x.t(), hidden)

    def init_hidden(self, bsz: int):
        return self.lm.init_hidden(bsz)


def gru_batch_first() -> nn.Module:
    return BatchFirst(gru())


def tokens(n: int, seed: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of SEQ tokens and their next tokens, batch-first (n, SEQ) as a loader yields them."""
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """The word_language_model loop: (batch, seq) from the data, transposed to (seq, batch) for the model,
    a fresh hidden state per batch, NLL over every token (a mean over the batch's sequences)."""
    x, y = batch
    out, _ = model(x.t(), model.init_hidden(x.shape[0]))
    return F.nll_loss(out, y.t().reshape(-1))


def batch_first_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out, _ = model(x, model.init_hidden(x.shape[0]))
    return F.nll_loss(out, y.t().reshape(-1))


def lm_loader(n: int = 21, batch: int = 8, seed: int = 3) -> DataLoader:
    return DataLoader(TensorDataset(*tokens(n)), batch_size=batch, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


@dataclasses.dataclass
class Rows:
    x: torch.Tensor  # (batch, 6)
    extra: torch.Tensor  # (batch, 2)
    y: torch.Tensor  # (batch,)
    tag: str = "train"  # not a tensor: no say in the count


class Pair(NamedTuple):
    x: torch.Tensor
    extra: torch.Tensor


def rows_dataset(n: int = 21) -> TensorDataset:
    x, y = w.digits_like(n)
    extra = torch.randn(n, 2, generator=torch.Generator().manual_seed(8))
    return TensorDataset(x, extra, y)


def rows_collate(samples: list) -> Rows:
    x, extra, y = (torch.stack(column) for column in zip(*samples))
    return Rows(x, extra, y)


def userdict_collate(samples: list) -> collections.UserDict:
    x, extra, y = (torch.stack(column) for column in zip(*samples))
    return collections.UserDict(x=x, extra=extra, y=y)


def rows_loader(collate: Callable, n: int = 21, batch: int = 8) -> DataLoader:
    return DataLoader(rows_dataset(n), batch_size=batch, shuffle=True, collate_fn=collate,
                      generator=torch.Generator().manual_seed(3))


class RowsNet(nn.Module):
    """forward takes the dataclass batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = w.mlp(features=8)

    def forward(self, batch: Rows) -> torch.Tensor:
        return self.net(torch.cat([batch.x, batch.extra], 1))


class MappingNet(RowsNet):
    """forward takes a Mapping (a collections.UserDict, which is no dict)."""

    def forward(self, batch: Mapping) -> torch.Tensor:
        return self.net(torch.cat([batch["x"], batch["extra"]], 1))


class PairNet(RowsNet):
    def forward(self, pair: Pair) -> torch.Tensor:
        return self.net(torch.cat([pair.x, pair.extra], 1))


class KwargsNet(RowsNet):
    def forward(self, *, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, extra], 1))


class ListNet(nn.Module):
    """forward takes Python values only (a list of rows of floats) and makes the tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = w.mlp()

    def forward(self, rows: list) -> torch.Tensor:
        return self.net(torch.tensor(rows, dtype=self.net[0].weight.dtype))


class WeightedNet(nn.Module):
    """forward(x (batch, 6), weights (3,) per class): two tensors whose first dimensions differ."""

    def __init__(self) -> None:
        super().__init__()
        self.net = w.mlp()

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        out = self.net(x)
        return out if weights is None else out * weights


CLASS_WEIGHTS = torch.tensor([1.0, 0.5, 2.0])


def rows_loss(model, batch: Rows) -> torch.Tensor:
    return F.cross_entropy(model(batch), batch.y)


def mapping_loss(model, batch: Mapping) -> torch.Tensor:
    return F.cross_entropy(model(batch), batch["y"])


def pair_loss(model, batch) -> torch.Tensor:
    x, extra, y = batch
    return F.cross_entropy(model(Pair(x, extra)), y)


def kwargs_loss(model, batch) -> torch.Tensor:
    x, extra, y = batch
    return F.cross_entropy(model(**{"x": x, "extra": extra}), y)


def ce_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def list_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x.tolist()), y)


def class_weighted_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x, CLASS_WEIGHTS), y)


# -- loops -----------------------------------------------------------------------------------------

def fit(model: nn.Module, data, loss_fn, opt_name: str = "sgd", epochs: int = 1,
        between: Callable[[nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """The usual loop; ``between(model)`` runs after every optimizer step (validation, say)."""
    opt = w.optimizer(opt_name, model)
    for _ in range(epochs):
        for batch in (data() if callable(data) else data):  # a callable gives each epoch's batches
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
            if between is not None:
                between(model)
    return w.state(model)


def parallel_copy(build: Callable[[], nn.Module]) -> nn.Module:
    """Rank 0 builds the reference's weights, the others other ones: parallelize must hand out rank 0's."""
    return w.seeded(build, 0 if w.rank() == 0 else 100 + w.rank())


def take(batch: Any, lo: int, hi: int) -> Any:
    """Rows [lo, hi) of a (nested) batch: tensors are cut, the structure and other values kept."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: take(getattr(batch, f.name), lo, hi)
                                             for f in dataclasses.fields(batch)})
    if isinstance(batch, Mapping):
        return type(batch)({k: take(v, lo, hi) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(take(v, lo, hi) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(take(v, lo, hi) for v in batch)
    return batch


def rows_in(batch: Any) -> int:
    """The batch size of a batch-first (nested) batch, as the global batches here all are."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if dataclasses.is_dataclass(batch):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        batch = list(batch.values())
    return next(rows_in(v) for v in batch if isinstance(v, (torch.Tensor, tuple, list, Mapping))
                or dataclasses.is_dataclass(v))


def split_for_ranks(global_batch: Any, size: int) -> list[Any]:
    """Every rank's contiguous slice of a global batch, as the sharded DataLoader cuts it."""
    n = rows_in(global_batch)
    return [take(global_batch, *slice_bounds(n, r, size)) for r in range(size)]


def two_epochs(loader: DataLoader) -> list:
    """The global batches of two epochs of a single-process loader (reshuffled in between)."""
    return [batch for _ in range(2) for batch in loader]


def hand_sliced(build, global_batches: list, loss_fn, opt_name: str = "sgd", between=None, **options):
    """Case D: parallelize(model) with no data; every rank takes its slice of each global batch by hand."""
    ref = fit(w.seeded(build, 0), global_batches, loss_fn, opt_name)
    model, none = autodist.parallelize(parallel_copy(build), **options)
    assert none is None
    mine = [split_for_ranks(b, dist.get_world_size())[w.rank()] for b in global_batches]
    return ref, fit(model, mine, loss_fn, opt_name, between=between)


def through_loader(build, make_loader: Callable[[], DataLoader], loss_fn, opt_name: str = "sgd", between=None,
                   iterate: Callable | None = None, **options):
    """Case A: parallelize(model, loader); two epochs. ``iterate(loader)`` gives an epoch's batches when the loop
    does not simply iterate the loader (all of them fetched first, or through engine.prefetch)."""
    ref = fit(w.seeded(build, 0), make_loader(), loss_fn, opt_name, epochs=2)
    model, data = autodist.parallelize(parallel_copy(build), make_loader(), **options)
    epoch = data if iterate is None else (lambda: iterate(data))
    return ref, fit(model, epoch, loss_fn, opt_name, epochs=2, between=between)


def tensor_steps(n: int, size: int, steps: int = 3) -> tuple[int, list[torch.Tensor], list[int]]:
    """Case B's batching of strided shards: the batch size b (ceil division, so that every rank takes
    ``steps`` steps), the sample indices of each *global* step (the union of the ranks' step-i slices
    xs[i*b:(i+1)*b], rank r's shard holding samples r, r+size, ...), and each rank's number of steps."""
    b = math.ceil(math.ceil(n / size) / steps)
    shards = [torch.arange(n)[r::size] for r in range(size)]
    per_rank = [len(range(0, len(s), b)) for s in shards]
    return b, [torch.cat([s[i * b:(i + 1) * b] for s in shards]) for i in range(max(per_rank))], per_rank


# sizes of case B: the strided shards must differ (21 on 2 ranks: 11 / 10; 22 on 3 ranks: 8 / 7 / 7;
# 21 on 3 ranks would give 7 / 7 / 7, which an unweighted mean gets right too)
TENSOR_N = {2: 21, 3: 22}


def tensor_path(build, loss_fn, steps: int = 3, epochs: int = 2):
    """Case B: parallelize(model, (x, y)); a plain loop over slices xs[i:i+b] of this rank's shard."""
    size = dist.get_world_size()
    n = TENSOR_N[size]
    x, y = tokens(n)
    b, global_steps, per_rank = tensor_steps(n, size, steps)
    assert per_rank == [steps] * size, per_rank
    ref = fit(w.seeded(build, 0), [(x[idx], y[idx]) for idx in global_steps], loss_fn, epochs=epochs)
    model, (xs, ys) = autodist.parallelize(parallel_copy(build), (x, y))
    assert torch.equal(xs, x[w.rank()::size]) and torch.equal(ys, y[w.rank()::size])
    opt = w.optimizer("sgd", model)
    for _ in range(epochs):
        for i in range(0, len(xs), b):
            opt.zero_grad()
            loss_fn(model, (xs[i:i + b], ys[i:i + b])).backward()
            opt.step()
    return ref, w.state(model)


# -- the cases, by group (each group runs in one call on the ranks) ------------------------------

def validation(who: str, val: Callable[[nn.Module], Any]) -> Callable[[nn.Module], None]:
    """Forwards with grad enabled and no backward, on rank 0 only or on every rank; their outputs (and
    graphs) are kept alive until the end of training."""
    kept: list = []

    def run(model: nn.Module) -> None:
        assert torch.is_grad_enabled()
        if who == "all" or w.rank() == 0:
            kept.append(val(model))
    return run


def lm_validation(who: str):
    val_x, _ = tokens(7, seed=99)
    return validation(who, lambda model: model(val_x.t(), model.init_hidden(7))[0])


def mlp_validation(who: str):
    val_x, _ = w.digits_like(7, seed=99)
    return validation(who, lambda model: model(val_x))


def lm_global_batches() -> list:
    return two_epochs(lm_loader())


def samples_fn_checked():
    """samples=count for the LM, checking it gets the forward's very arguments, as forward gets them."""
    seen: list = []
    last: list = []

    def count(x, hidden):  # two positional parameters: called as fn(*args, **kwargs)
        seen.append((x, hidden))
        return x.shape[1]

    def loss_fn(model, batch):
        x, y = batch
        x_t, hidden = x.t(), model.init_hidden(x.shape[0])
        last[:] = [x_t, hidden]
        out, _ = model(x_t, hidden)
        return F.nll_loss(out, y.t().reshape(-1))

    def check(model):
        assert seen, "samples= was never called"
        assert seen[-1][0] is last[0] and seen[-1][1] is last[1], "samples= did not get forward's arguments"
    return count, loss_fn, check


def _gru_samples_case():
    count, loss_fn, check = samples_fn_checked()
    return hand_sliced(gru, lm_global_batches(), loss_fn, between=check, samples=count)


def error_message(build, call: Callable[[nn.Module], torch.Tensor], **options) -> str:
    """Forward (must not raise), then backward (must raise): the backward's message, or what went wrong."""
    model, _ = autodist.parallelize(w.seeded(build, 0), **options)
    try:
        out = call(model)
    except Exception as err:  # noqa: BLE001
        return f"the forward raised, not the backward: {type(err).__name__}: {err}"
    try:
        out.float().logsumexp(-1).mean().backward()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "the backward did not raise"


X4, W3 = w.digits_like(4, seed=5)[0], CLASS_WEIGHTS  # 4 rows and 3 class weights: which is the batch?


def _gru_default_batch_dim(model):
    x, _ = tokens(4)
    return model(x.t(), model.init_hidden(4))[0]  # (SEQ=5, 4) and hidden (2, 4, 8): dim 0 says 5 or 2


def ambiguous_validation(model: nn.Module) -> None:
    """Ambiguous forwards that no backward follows: on rank 0, then on every rank."""
    if w.rank() == 0:
        model(X4, W3)
    model(X4, weights=W3)


def _cases(group: str) -> dict[str, Callable[[], Any]]:
    size = dist.get_world_size()
    if group == "loader":  # A, sizes 2 and 3: 21 sequences in global batches of 8, 8, 5
        return {
            "gru_sgd": lambda: through_loader(gru, lm_loader, lm_loss),
            "lstm_tied_adam_f64": lambda: through_loader(lstm_tied_f64, lm_loader, lm_loss, "adam"),
            "dataclass_batch": lambda: through_loader(RowsNet, lambda: rows_loader(rows_collate), rows_loss),
            "userdict_batch": lambda: through_loader(MappingNet, lambda: rows_loader(userdict_collate),
                                                     mapping_loss),
            "control_batch_first": lambda: through_loader(gru_batch_first, lm_loader, batch_first_loss),
        }
    if group == "tensors":  # B, sizes 2 and 3
        return {
            "gru_sgd": lambda: tensor_path(gru, lm_loss),
            "control_batch_first": lambda: tensor_path(gru_batch_first, batch_first_loss),
        }
    if group == "validation":  # C, 2 ranks: 21 samples in global batches of 8, 8, 5 (last one 3 / 2)
        mlp_loader = lambda: w.loader(*w.digits_like(21), 8)  # noqa: E731
        mlp_batches = two_epochs(mlp_loader())
        return {
            "loader_mlp_rank0": lambda: through_loader(w.mlp, mlp_loader, ce_loss, between=mlp_validation("rank0")),
            "loader_mlp_all": lambda: through_loader(w.mlp, mlp_loader, ce_loss, between=mlp_validation("all")),
            "loader_gru_rank0": lambda: through_loader(gru, lm_loader, lm_loss, between=lm_validation("rank0")),
            "hand_mlp_rank0": lambda: hand_sliced(w.mlp, mlp_batches, ce_loss, between=mlp_validation("rank0")),
            "hand_mlp_all": lambda: hand_sliced(w.mlp, mlp_batches, ce_loss, between=mlp_validation("all")),
            "hand_gru_batch_dim1_rank0": lambda: hand_sliced(gru, lm_global_batches(), lm_loss,
                                                             between=lm_validation("rank0"), batch_dim=1),
        }
    if group == "hand":  # D, 2 ranks: hand-sliced global batches of 8, 8, 5
        rows = two_epochs(DataLoader(rows_dataset(), batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(3)))
        return {
            "gru_batch_dim1": lambda: hand_sliced(gru, lm_global_batches(), lm_loss, batch_dim=1),
            "gru_samples_fn": _gru_samples_case,
            "gru_samples_lambda": lambda: hand_sliced(gru, lm_global_batches(), lm_loss,
                                                      samples=lambda x, h: x.shape[1]),
            "lstm_tied_adam_f64_batch_dim1": lambda: hand_sliced(lstm_tied_f64, lm_global_batches(), lm_loss,
                                                                 "adam", batch_dim=1),
            "dataclass_batch": lambda: hand_sliced(RowsNet, [rows_collate(list(zip(*b))) for b in rows],
                                                   rows_loss),
            "userdict_batch": lambda: hand_sliced(MappingNet, [userdict_collate(list(zip(*b))) for b in rows],
                                                  mapping_loss),
            "namedtuple_batch": lambda: hand_sliced(PairNet, rows, pair_loss),
            "keyword_arguments": lambda: hand_sliced(KwargsNet, rows, kwargs_loss),
        }
    if group == "errors":  # E, 2 ranks
        batches7 = two_epochs(w.loader(*w.digits_like(21), 7))  # 7 = 4 + 3 on two ranks
        return {
            "no_tensor": lambda: error_message(ListNet, lambda m: m(X4.tolist())),
            "disagree_positional": lambda: error_message(WeightedNet, lambda m: m(X4, W3)),
            "disagree_keyword": lambda: error_message(WeightedNet, lambda m: m(X4, weights=W3)),
            "seq_first_default_batch_dim": lambda: error_message(gru, _gru_default_batch_dim),
            "ambiguous_validation": lambda: hand_sliced(WeightedNet, batches7, ce_loss,
                                                        between=ambiguous_validation),
            "samples_fn_no_tensor": lambda: hand_sliced(ListNet, batches7, list_loss,
                                                        samples=lambda rows: len(rows)),
            "samples_fn_disagree": lambda: hand_sliced(WeightedNet, batches7, class_weighted_loss,
                                                       samples=lambda x, weights: x.shape[0]),
        }
    # F, sizes 2 and 3: 17 sequences in global batches of 8, 8, 1, so the last one leaves one rank (of two)
    # or two (of three) with an empty slice; one group each, so that a hang takes down only its own case
    empty_slices = lambda iterate=None: through_loader(gru_f64, lambda: lm_loader(17), lm_loss, "adam",  # noqa: E731
                                                       iterate=iterate)
    if group == "empty_live":
        return {"empty_slice_gru_adam_f64": empty_slices}
    if group == "empty_listed":  # the loop fetches an epoch's batches first: list(loader)
        return {"empty_slice_gru_adam_f64_listed": lambda: empty_slices(list)}
    if group == "empty_prefetch":
        return {"empty_slice_gru_adam_f64_prefetch": lambda: empty_slices(engine.prefetch)}
    if group == "no_sync":
        return {"no_sync_gru_adam_f64": lambda: accumulate_lm(size)}
    raise KeyError(group)


def accumulate_lm(size: int, micro: int = 2, n: int = 17):
    """no_sync accumulation of `micro` global micro-batches of 5 sequences per step (5, 5 | 5, 2): the last
    step's micro-batches split 3/2 | 1/1 on 2 ranks, 2/2/1 | 1/1/0 on 3."""
    ref_model, model = w.seeded(gru_f64, 0), parallel_copy(gru_f64)
    make = lambda: DataLoader(TensorDataset(*tokens(n)), batch_size=5)  # noqa: E731
    model, data = autodist.parallelize(model, make())
    ref_opt, opt = w.optimizer("adam", ref_model), w.optimizer("adam", model)
    ref_batches, batches = list(make()), list(data)
    assert len(batches) == len(ref_batches) == 4
    for start in range(0, len(batches), micro):
        for i in range(start, start + micro):
            (lm_loss(ref_model, ref_batches[i]) / micro).backward()
            if i < start + micro - 1:
                with autodist.no_sync(model):
                    (lm_loss(model, batches[i]) / micro).backward()
            else:
                (lm_loss(model, batches[i]) / micro).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    return w.state(ref_model), w.state(model)


def _run_group(group: str) -> dict[str, dict[str, Any]]:
    """Every case of a group on this rank: {"ok": result} or {"raised": traceback}."""
    out: dict[str, dict[str, Any]] = {}
    for name, case in _cases(group).items():
        try:
            out[name] = {"ok": case()}
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            out[name] = {"raised": traceback.format_exc()}
    return out


# -- the tests -------------------------------------------------------------------------------------

_results: dict[tuple[str, int], Any] = {}


@pytest.fixture
def case(ranks):
    """case(group, size, name): that case's per-rank results; the group runs once per size."""
    def get(group: str, size: int, name: str) -> list[Any]:
        key = (group, size)
        if key not in _results:
            try:
                _results[key] = ranks(size, _run_group, group, timeout=60)  # gloo gives up on a collective at 60 s
            except AssertionError as err:  # RankFailure: a rank crashed or hung; every case of the group fails
                _results[key] = err
        results = _results[key]
        if isinstance(results, AssertionError):
            raise results
        raised = {r: res[name]["raised"] for r, res in enumerate(results) if "raised" in res[name]}
        if raised:
            pytest.fail("\n".join(f"--- rank {r} raised in case {name!r}:\n{tb}" for r, tb in raised.items()),
                        pytrace=False)
        return [res[name]["ok"] for res in results]
    return get


def _simulate(build, steps: list[list], loss_fn, weighting: str) -> dict[str, torch.Tensor]:
    """One process playing the ranks: each step's loss is the global batch's ("global"), the ranks' losses
    weighted by their shares n_r / N ("weighted"), or their plain mean ("plain", what DDP computes)."""
    model = w.seeded(build, 0)
    opt = w.optimizer("sgd", model)
    for parts in steps:
        opt.zero_grad()
        if weighting == "global":
            loss = loss_fn(model, tuple(torch.cat(column) for column in zip(*parts)))
        else:
            live = [p for p in parts if rows_in(p) > 0]
            total = sum(rows_in(p) for p in live)
            losses = [loss_fn(model, p) for p in live]
            loss = (sum(l * (rows_in(p) / total) for l, p in zip(losses, live)) if weighting == "weighted"
                    else sum(losses) / len(parts))
        loss.backward()
        opt.step()
    return w.state(model)


@pytest.mark.parametrize("path", ["loader", "tensors"])
@pytest.mark.parametrize("size", [2, 3])
def test_plain_mean_is_not_the_reference(size, path):
    # The references below train on the concatenated global batches. Check, in one process, that this is
    # what weighting the ranks' gradients by n_r / N gives (so exactness is reachable at the tolerance), and
    # that a plain mean of the ranks' gradients, which a count that is the same on every rank amounts to
    # (e.g. the sequence length of a seq-first input), misses it: the parallel tests are sensitive.
    if path == "loader":
        steps = [split_for_ranks(b, size) for b in lm_global_batches()]
        for parts, batch in zip(steps, lm_global_batches()):
            assert all(torch.equal(torch.cat(c), t) for c, t in zip(zip(*parts), batch))
    else:
        n = TENSOR_N[size]
        x, y = tokens(n)
        b, global_steps, per_rank = tensor_steps(n, size)
        assert per_rank == [3] * size
        assert sorted(torch.cat(global_steps).tolist()) == list(range(n))  # every sample once an epoch
        steps = 2 * [[(x[r::size][i:i + b], y[r::size][i:i + b]) for r in range(size)] for i in range(0, 3 * b, b)]
        for parts, idx in zip(steps, 2 * global_steps):
            assert torch.equal(torch.cat([p[0] for p in parts]), x[idx])
    assert any(len({rows_in(p) for p in parts}) > 1 for parts in steps)  # uneven somewhere
    reference = _simulate(gru, steps, lm_loss, "global")
    assert_close(_simulate(gru, steps, lm_loss, "weighted"), reference, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        assert_close(_simulate(gru, steps, lm_loss, "plain"), reference, rtol=1e-5, atol=1e-6)


def test_slice_bounds_is_there():
    assert [slice_bounds(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]


# A: data through the DataLoader


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", ["gru_sgd", "lstm_tied_adam_f64", "dataclass_batch", "userdict_batch"])
def test_loader_weights_come_from_the_loader(case, size, name):
    assert_same_training(case("loader", size, name))


@pytest.mark.parametrize("size", [2, 3])
def test_control_batch_first_language_model(case, size):
    # the same loops with the model called batch-first: exact already with a first-dimension count, so a
    # failure of the seq-first cases is the weighting, not the harness
    assert_same_training(case("loader", size, "control_batch_first"))
    assert_same_training(case("tensors", size, "control_batch_first"))


# B: tensors sharded strided, sliced by the user


@pytest.mark.parametrize("size", [2, 3])
def test_tensor_shards_sliced_and_fed_seq_first(case, size):
    assert_same_training(case("tensors", size, "gru_sgd"))


# C: forwards no backward follows


@pytest.mark.parametrize("name", ["loader_mlp_rank0", "loader_mlp_all", "loader_gru_rank0", "hand_mlp_rank0",
                                  "hand_mlp_all", "hand_gru_batch_dim1_rank0"])
def test_validation_forwards_with_grad_do_not_count(case, name):
    assert_same_training(case("validation", 2, name))


# D: data autodist did not shard


@pytest.mark.parametrize("name", ["gru_batch_dim1", "gru_samples_fn", "gru_samples_lambda",
                                  "lstm_tied_adam_f64_batch_dim1", "dataclass_batch", "userdict_batch",
                                  "namedtuple_batch", "keyword_arguments"])
def test_hand_sliced_batches_are_counted_from_the_forward(case, name):
    assert_same_training(case("hand", 2, name))


# E: counts that cannot be inferred


@pytest.mark.parametrize("name, paths", [
    ("no_tensor", ["args[0]"]),
    ("disagree_positional", ["args[0]", "args[1]"]),
    ("disagree_keyword", ["args[0]", "kwargs['weights']"]),
    ("seq_first_default_batch_dim", ["args[0]", "args[1]"]),
])
def test_ambiguous_count_raises_at_backward_on_every_rank(case, name, paths):
    for message in case("errors", 2, name):
        assert "cannot count the samples" in message, message
        assert "batch_dim=" in message and "samples=" in message, message
        for path in paths:
            assert path in message, message


def test_ambiguous_forward_without_backward_does_not_raise(case):
    assert_same_training(case("errors", 2, "ambiguous_validation"))


@pytest.mark.parametrize("name", ["samples_fn_no_tensor", "samples_fn_disagree"])
def test_samples_fn_trains_the_ambiguous_models(case, name):
    assert_same_training(case("errors", 2, name))


# F: exactness that must stay


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("group, name", [
    ("empty_live", "empty_slice_gru_adam_f64"),
    ("empty_listed", "empty_slice_gru_adam_f64_listed"),
    ("empty_prefetch", "empty_slice_gru_adam_f64_prefetch"),
    ("no_sync", "no_sync_gru_adam_f64"),
])
def test_empty_slices_and_no_sync_with_a_seq_first_model(case, size, group, name):
    results = case(group, size, name)
    assert_same_training(results)
    assert all(torch.isfinite(t).all() for t in results[0][1].values())
