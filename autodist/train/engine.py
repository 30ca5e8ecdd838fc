"""Training-loop helpers: prefetching, exact metrics across ranks, evaluation, progress and logs.

Each helper stands alone (in the spirit of TorchMPI's AllReduceSGDEngine, but
as functions a plain loop calls rather than an engine that owns the loop):

* :func:`prefetch` fetches the next batches on a background thread;
* :class:`Metrics` sums loss, correct predictions and samples on each rank and
  averages them exactly over the data-parallel ranks (and, for a low-communication
  mode, adds how far its replicas drifted apart: :func:`drift`);
* :func:`evaluate` splits a test set over the data-parallel ranks and returns
  the same numbers one process would compute on the whole of it;
* :func:`progress`, :func:`rank_logger`, :func:`epoch_summary` and
  :func:`log_epoch` print from rank 0 (or say which rank speaks).

Example:
    >>> metrics = engine.Metrics()
    >>> for x, y in engine.progress(engine.prefetch(loader), total=len(loader)):
    ...     out = model(x); loss = F.cross_entropy(out, y)
    ...     ...
    ...     metrics.update(loss.detach() * len(y), (out.argmax(1) == y).sum(), len(y))
    >>> engine.log_epoch(epoch, metrics.reduce(model), engine.evaluate(model, test_set), seconds)
"""
from __future__ import annotations

import logging
import operator
import queue
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from autodist.dp import abandoned
from autodist.dp.grad_sync import registration_of
from autodist.faults import elastic
from autodist.faults.liveness import named
from autodist.runtime import provenance
from autodist.runtime.world import init, log
from autodist.sync import Exact, strategy_of

T = TypeVar("T")

_POLL_S = 0.05  # how often a producer blocked on a full queue looks for a stop request
_JOIN_S = 5.0  # how long close() waits for the producer to leave the source iterator's next()


# -- prefetch --------------------------------------------------------------------------------------

def _to_device(obj: Any, device: torch.device | None) -> Any:
    """``obj`` with its tensors (also inside tuples, lists, dicts) on ``device``; other leaves as they are."""
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        pinned = obj.device.type == "cpu" and device.type != "cpu" and obj.is_pinned()
        return obj.to(device, non_blocking=pinned)  # pinned: the copy overlaps the current step
    if isinstance(obj, dict):
        return type(obj)({k: _to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _offer(out: queue.Queue, stop: threading.Event, entry: tuple[str, Any]) -> bool:
    """Put ``entry`` once there is room; False if the consumer stopped first."""
    while not stop.is_set():
        try:
            out.put(entry, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _fetched(item: Any, device: torch.device | None) -> tuple[str, Any]:
    """A queue entry for a batch just fetched in this thread: the batch on ``device``, and the share of the global
    batch that a sharded DataLoader announced with it (handed over again when the loop takes the batch)."""
    share = provenance.current()
    moved = _to_device(item, device)
    if share is not None and moved is not item:
        provenance.register_batch(moved, share)
    return "item", (moved, share)


def _produce(source: Iterator[Any], out: queue.Queue, stop: threading.Event, device: torch.device | None) -> None:
    """The background thread: iterate ``source`` into ``out`` until done, failed or stopped."""
    try:
        for item in source:
            if not _offer(out, stop, _fetched(item, device)):
                break
        else:
            _offer(out, stop, ("done", None))
    except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
        _offer(out, stop, ("error", error))
    finally:
        close = getattr(source, "close", None)
        if stop.is_set() and callable(close):
            close()  # a generator source runs its own cleanup now, in the thread that ran it


def _length_of(batches: Iterable[Any]) -> int | None:
    try:
        return len(batches)  # type: ignore[arg-type]
    except TypeError:  # no len(), or one that refuses (a DataLoader over an IterableDataset)
        return None


class Prefetcher(Iterator[T]):
    """The iterator :func:`prefetch` returns: a background thread keeps up to ``depth`` batches ready.

    ``close()`` (or leaving a ``with`` block, or dropping the last reference)
    stops the thread; batches fetched but not consumed are dropped.
    """

    def __init__(self, batches: Iterable[T], depth: int, device: torch.device | None) -> None:
        self._length = _length_of(batches)
        # The first batch is fetched here, in the caller's thread: a DataLoader from parallelize agrees on
        # the epoch's order by a collective at its first batch, and collectives must keep one order on
        # every rank, which a background thread racing the training step's collectives would not.
        source = iter(batches)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        try:
            self._queue.put(_fetched(next(source), device))
        except StopIteration:
            self._queue.put(("done", None))
            source = iter(())
        except Exception as error:  # noqa: BLE001 - raised at the first batch, like any other
            self._queue.put(("error", error))
            source = iter(())
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop, device),
                                        name="autodist-prefetch", daemon=True)
        weakref.finalize(self, self._stop.set)  # an abandoned iterator (loop left by break) stops its thread
        self._thread.start()

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == "item":
            batch, share = value
            provenance.announce(share, batch)  # the step about to run uses this batch, not the ones fetched ahead
            return batch
        provenance.announce(None)
        self.close()
        if kind == "error":
            raise value
        raise StopIteration

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("prefetch() was given an iterable without len(); pass total= to progress()")
        return self._length

    def close(self) -> None:
        """Stop the background thread and wait for it (idempotent)."""
        self._finished = True
        self._stop.set()
        while True:  # free the producer if it is blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)
        if self._thread.is_alive():
            log.warning("the prefetch thread is still inside the data source's next() after %.0f s; it will "
                        "exit when that call returns", _JOIN_S)

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefetch(batches: Iterable[T], depth: int = 2, device: torch.device | str | None = None) -> Prefetcher[T]:
    """Iterate ``batches`` with the next ones fetched on a background thread while this one trains.

    Args:
        batches: any iterable (a DataLoader, a list, a generator).
        depth: how many batches may wait ready (at least 1).
        device: if given, tensors (also inside tuples, lists and dicts) are
            moved there in the background, asynchronously when they sit in
            pinned memory (``DataLoader(pin_memory=True)``).

    Returns:
        An iterator over the same batches, in the same order (the very same
        objects when ``device`` is None). An exception raised while fetching is
        raised again here, at the batch where it happened.

    Example:
        >>> for x, y in engine.prefetch(loader, device=world.device):
        ...     train_step(x, y)

    Note:
        Stopping early (``break``) is safe: the thread stops once the iterator
        is closed or dropped, and a source iterator with ``close()`` (a
        generator) is closed. Use
        ``with engine.prefetch(...) as batches:`` to stop it at a known point.
        The first batch is fetched in the calling thread (a DataLoader from
        ``parallelize`` may agree on the epoch's order there). With
        ``num_workers=0`` the thread runs your dataset's code: random
        augmentation there draws from torch's global RNG concurrently with
        dropout in the training step, so under model parallelism (whose ranks
        must draw alike) give the DataLoader workers (``num_workers > 0``, each
        seeded alike within a model-parallel group) or augment with a
        ``torch.Generator`` of your own.
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"depth must be a positive int (batches kept ready), got {depth!r}")
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread has its own current device: name it
            device = torch.device("cuda", torch.cuda.current_device())
    return Prefetcher(batches, depth, device)


# -- metrics ---------------------------------------------------------------------------------------

def _data_parallel(model: nn.Module | None) -> tuple[int, int, dist.ProcessGroup | None]:
    """(rank, size, group) of the ranks that see different samples; group None is the whole world."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module (or None) for model, {type(model).__name__} found")
    registration = registration_of(model) if model is not None else None
    if registration is not None:
        return registration.dp_rank, registration.dp, registration.dp_group
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), None
    return 0, 1, None


def _one_number(value: float | torch.Tensor, name: str, hint: str) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number summed over the batch, got a tensor of shape "
                             f"{tuple(value.shape)}; sum it first (e.g. {hint})")
        return value.detach().reshape(()).to(torch.float64)  # stays on its device: no sync per step
    return float(value)


class Metrics:
    """Loss, correct predictions and samples summed on this rank, averaged exactly over the ranks.

    Sums, not averages, are kept and all-reduced, so the result is the average
    over every sample of the data-parallel ranks together, whatever each rank
    holds (uneven shards, empty ranks).

    Example:
        >>> metrics = engine.Metrics()
        >>> metrics.update(loss.detach() * len(y), (out.argmax(1) == y).sum(), len(y))
        >>> metrics.reduce(model)
        {'loss': 0.41, 'accuracy': 88.1, 'count': 50000, 'correct': 44050}
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything summed so far."""
        self.loss_sum: float | torch.Tensor = 0.0
        self.correct: float | torch.Tensor = 0.0
        self.count = 0
        self.members: tuple[int, ...] | None = None  # an elastic job's ranks alive as these sums began
        self.by_batch: dict[int, tuple[Any, Any, int]] = {}  # elastic: each batch's sums, until reduce

    def update(self, loss_sum: float | torch.Tensor, correct: int | torch.Tensor, count: int) -> None:
        """Add one batch.

        Args:
            loss_sum: the loss summed over the batch's samples (mean loss x count).
            correct: how many predictions were right.
            count: samples in the batch. A batch of 0 samples is ignored (its
                mean loss may be NaN), and so is the stand-in row a rank gets for a
                global batch it holds no row of (the current batch of the DataLoader
                ``parallelize`` returned, with a share of 0: its sample counts on the
                rank that holds it).
        """
        try:
            count = operator.index(count)
        except TypeError:
            raise TypeError(f"count must be an int (samples in the batch), got {type(count).__name__}") from None
        if count < 0:
            raise ValueError(f"count must be >= 0 (samples in the batch), got {count}")
        share = provenance.current()
        if count == 0 or (share is not None and share.count == 0):
            return
        loss_sum = _one_number(loss_sum, "loss_sum", "loss_fn(out, y, reduction='sum')")
        correct = _one_number(correct, "correct", "(out.argmax(1) == y).sum()")
        state = elastic.current()
        if state is not None and share is not None:  # kept by batch: one taken again after a regroup counts once
            if self.members is None:
                self.members = state.members
            before = self.by_batch.get(share.batch, (0.0, 0.0, 0))
            self.by_batch[share.batch] = (before[0] + loss_sum, before[1] + correct, before[2] + count)
            return
        self.loss_sum = self.loss_sum + loss_sum
        self.correct = self.correct + correct
        self.count += count

    def reduce(self, model: nn.Module | None = None, *, with_drift: bool = True) -> dict[str, float]:
        """Averages over every sample of the data-parallel ranks; every rank must call it.

        Args:
            model: the model the samples went through. If ``autodist.parallelize``
                made it, the sums are added over its data-parallel ranks only
                (ranks of one model-parallel group saw the same samples and
                count once); otherwise over the whole world, if there is one.

        Returns:
            ``{"loss": mean loss, "accuracy": percent correct, "count": samples,
            "correct": correct predictions}``, the same on every rank; loss and
            accuracy are NaN when no rank saw a sample. For a model trained with a
            low-communication mode, :func:`drift`'s keys too (``spread``,
            ``bytes_sent``, ``syncs``) unless ``with_drift=False``. The sums are kept: call :meth:`reset` to
            start over.

        Under ``autodist run --elastic`` the sums are added over the ranks alive together, as a gradient sync
        is: a rank lost before or during the sum is left out and the ranks left sum again. The samples a lost
        rank counted went with it: rank 0 says how many ranks were lost since the sums began, and ``count``
        is what the ranks left counted.
        """
        _, size, group = _data_parallel(model)
        for batch, (loss_sum, correct, count) in list(self.by_batch.items()):
            del self.by_batch[batch]
            if not abandoned.was_dropped(batch):  # not an abandoned iteration's
                self.loss_sum, self.correct, self.count = self.loss_sum + loss_sum, self.correct + correct, \
                    self.count + count
        parts = (self.loss_sum, self.correct, self.count)
        state = elastic.current()
        if state is not None:
            sums = state.all_reduce(torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).cpu()
                                                 for v in parts]), "metrics' sum")
            loss_sum, correct, count = sums.tolist()
            self._said_lost(state)
        elif size > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
                else torch.device("cpu")
            sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in parts])
            dist.all_reduce(sums, group=group)
            loss_sum, correct, count = sums.tolist()
        else:
            loss_sum, correct, count = (float(v) for v in parts)
        count, correct = int(round(count)), int(round(correct))
        nan = float("nan")
        return {"loss": loss_sum / count if count else nan, "accuracy": 100.0 * correct / count if count else nan,
                "count": count, "correct": correct, **(drift(model) if model is not None and with_drift else {})}


    def _said_lost(self, state: elastic.Elastic) -> None:
        lost = [r for r in self.members or () if r not in state.members]
        if lost and state.rank == 0:
            log.warning("engine.Metrics: lost since these sums began: %s, with the samples counted there; the "
                        "averages are over the samples the ranks left counted (reset() each epoch starts the next "
                        "one whole)", named(lost))


def drift(model: nn.Module) -> dict[str, float]:
    """How far the replicas of a low-communication mode have drifted apart, and what this rank sent.

    Args:
        model: a model parallelized with ``sync=autodist.LocalSGD(...)``, ``DiLoCo``, ``Gossip`` or
            ``Hierarchical``.

    Returns:
        ``{"spread": max over ranks of ||theta_r - mean|| / ||mean||, "bytes_sent": bytes this rank sent
        for the mode so far, "syncs": its averages (gossip: rounds)}``; an empty dict for exact sync, a
        model not parallelized, or a world of one.

    Example:
        >>> engine.drift(model)          # every rank: the spread is a collective
        {'spread': 0.0132, 'bytes_sent': 1572864.0, 'syncs': 12}

    Note:
        Every data-parallel rank must call it (one all-reduce and one all-gather of the parameters).
        ``Metrics.reduce(model)`` adds these keys by itself.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    strategy = strategy_of(model)
    if strategy is None or isinstance(strategy, Exact):
        return {}
    syncs = getattr(strategy, "syncs", getattr(strategy, "rounds", 0))
    return {"spread": strategy.spread(), "bytes_sent": float(strategy.bytes_sent), "syncs": int(syncs)}


# -- evaluation ------------------------------------------------------------------------------------

def _strided_part(dataset: Dataset, rank: int, size: int) -> Dataset:
    """Samples rank, rank+size, ...; unlike data.shard_dataset, a rank may get none (it adds nothing)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(f"evaluate needs a map-style Dataset with len() to split over the ranks, got "
                        f"{type(dataset).__name__}; an IterableDataset cannot be split by index")
    return dataset if size == 1 else Subset(dataset, range(rank, len(dataset), size))


def _pair(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    found = f"{len(batch)} items" if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}"
    raise ValueError(f"evaluate expects the dataset to yield (input, target) pairs, its batches hold {found}; "
                     f"wrap it in a Dataset whose items are (input, target)")


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 256,
             loss_fn: Callable[..., torch.Tensor] = F.cross_entropy) -> dict[str, float]:
    """Loss and accuracy of a classifier on ``dataset``, split over the data-parallel ranks.

    Args:
        model: the model (parallelized or not); it runs in eval mode under
            ``torch.no_grad()`` and gets its previous train/eval modes back.
        dataset: a map-style Dataset of (input, target class) pairs: the whole
            test set, the same on every rank.
        batch_size: samples per forward pass on each rank.
        loss_fn: called as ``loss_fn(output, target, reduction="sum")``.

    Returns:
        :meth:`Metrics.reduce`'s dict: the mean per-sample loss and the
        accuracy over the whole dataset, exactly as one process computes them,
        on every rank.

    Example:
        >>> test = engine.evaluate(model, test_set)     # on every rank
        >>> test["accuracy"]
        87.22

    Note:
        Every rank must call it. Data-parallel rank r evaluates samples r,
        r+P, ...; the ranks of one model-parallel group evaluate the same
        samples together, as their split layers require.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    rank, size, _ = _data_parallel(model)
    part = _strided_part(dataset, rank, size)
    device = next(model.parameters(), torch.empty(0)).device
    modes = {m: m.training for m in model.modules()}
    metrics = Metrics()
    model.eval()
    outer = provenance.current()
    provenance.announce(None)  # not the training batch in hand (a stand-in's updates would be skipped)
    try:
        with torch.no_grad():
            for batch in DataLoader(part, batch_size=batch_size):
                x, y = _pair(_to_device(batch, device))
                out = model(x)
                metrics.update(loss_fn(out, y, reduction="sum"), (out.argmax(1) == y).sum(), len(y))
    finally:
        provenance.announce(outer)
        for module, training in modes.items():
            module.training = training
    return metrics.reduce(model, with_drift=False)


# -- progress and logs -----------------------------------------------------------------------------

def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", *, disable: bool = False,
             **tqdm_options: Any) -> Iterable[T]:
    """A tqdm progress bar (to stderr) on rank 0; ``iterable`` itself on the other ranks.

    Args:
        iterable: what the loop runs over.
        total: its length, if ``len(iterable)`` does not tell.
        desc: the bar's label.
        disable: no bar on any rank.
        tqdm_options: passed on to ``tqdm.tqdm``.

    Returns:
        A tqdm bar wrapping ``iterable`` on rank 0 when tqdm is installed;
        otherwise ``iterable`` unchanged.

    Example:
        >>> for x, y in engine.progress(loader, desc=f"epoch {epoch}"):
        ...     train_step(x, y)
    """
    if disable or init().rank != 0:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # optional: pip install tqdm (autodist's "examples" extra)
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, **tqdm_options)


class _RankPrefix(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"{self.extra['prefix']} {msg}", kwargs


def _train_logger(name: str) -> logging.Logger:
    """The named logger, given a plain stderr handler unless it (or the user) already has one."""
    logger = logging.getLogger(name)
    init()  # sets autodist's log level (AUTODIST_LOG_LEVEL), which "autodist.*" loggers inherit
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # not also through autodist's "[autodist rank R]" handler
    return logger


def rank_logger(name: str = "autodist.train") -> logging.LoggerAdapter:
    """A logger whose lines start with ``[rank R/S]``, printing to stderr.

    Args:
        name: the logger's name; under "autodist." it follows autodist's level
            (environment variable AUTODIST_LOG_LEVEL, INFO by default).

    Returns:
        A ``logging.LoggerAdapter``; every rank that calls it logs.

    Example:
        >>> engine.rank_logger().info("loaded %d images", 50000)
        [rank 1/4] loaded 50000 images
    """
    world = init()
    return _RankPrefix(_train_logger(name), {"prefix": f"[rank {world.rank}/{world.size}]"})


def _summary_part(name: str, metrics: dict) -> str:
    if not isinstance(metrics, dict) or not ({"loss", "accuracy"} & metrics.keys()):
        found = sorted(metrics) if isinstance(metrics, dict) else type(metrics).__name__
        raise ValueError(f"{name} must be a dict with 'loss' and/or 'accuracy' (as Metrics.reduce returns), "
                         f"got {found}")
    words = [name]
    if "loss" in metrics:
        words.append(f"loss {metrics['loss']:.4f}")
    if "accuracy" in metrics:
        words.append(f"acc {metrics['accuracy']:.2f}%")
    if "spread" in metrics:  # a low-communication mode: how far its replicas drifted apart
        words.append(f"spread {metrics['spread']:.2e}")
    return " ".join(words)


def epoch_summary(epoch: int, train: dict, test: dict | None, seconds: float) -> str:
    """One line for an epoch.

    Example:
        >>> epoch_summary(3, {"loss": 0.41234, "accuracy": 88.1}, {"loss": 0.45, "accuracy": 87.22}, 1.234)
        'epoch 3 | train loss 0.4123 acc 88.10% | test loss 0.4500 acc 87.22% | 1.23 s'
    """
    parts = [f"epoch {epoch}", _summary_part("train", train)]
    if test is not None:
        parts.append(_summary_part("test", test))
    parts.append(f"{seconds:.2f} s")
    return " | ".join(parts)


def log_epoch(epoch: int, train: dict, test: dict | None, seconds: float, *,
              logger: logging.Logger | logging.LoggerAdapter | None = None) -> str:
    """Log :func:`epoch_summary`'s line on rank 0 (at INFO, through :func:`rank_logger` by default); return it.

    Every rank may call it (only rank 0 prints), so a loop needs no rank test.
    """
    line = epoch_summary(epoch, train, test, seconds)
    if init().rank == 0:
        (logger or rank_logger()).info(line)
    return line
