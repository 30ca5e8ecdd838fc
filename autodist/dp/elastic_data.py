"""The sharded DataLoader in elastic mode: after a lost rank, the batches since the last applied step again,
each global batch split over the ranks left.

Each time the loop asks for a batch, the loader first looks at the elastic state
(:mod:`autodist.faults.elastic`): if a sync was applied since the last batch, every batch taken so far is in the
training; if the ranks regrouped, the batches taken since the last applied sync were abandoned, and the epoch
goes on from there: its generators set back to how it began, the batches before passed over by index (no
sample is loaded: :mod:`autodist.dp.loader_position`, as a checkpoint resumes; a stream is read again from the
epoch's start, each batch checked against the one read before), and each later global batch split over the new
generation's ranks. The loop sees one more iteration per abandoned step; the epoch ends
where one process's does.

A sampler that draws from the global RNG (``shuffle=True`` without a generator) draws on every rank, and the
epoch's order is the one the first rank to draw wrote into the store, kept there for the epoch: no collective
(which a lost rank could break), and an epoch taken up again after a regroup keeps its order.

Example:
    >>> model, loader = autodist.parallelize(model, loader)     # under autodist run --elastic
    >>> for x, y in loader: ...                                  # a rank lost at step 7: step 7 comes twice
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from autodist.dp import abandoned, joining, loader_position
from autodist.dp.handover import handed_over
from autodist.faults import elastic
from autodist.runtime import provenance

KEPT_EPOCHS = 2  # orders kept in the store per loader: the epoch in progress and the one before


class ElasticOrder:
    """An epoch's sample order, the same on every rank, through the store (see the module docstring); ``key``
    names the loader and epoch, set by :func:`epoch` before each iteration."""

    def __init__(self) -> None:
        self.key = ""

    def __call__(self, order: Iterable[int]) -> list[int]:
        drawn = ",".join(map(str, order))  # every rank draws: the global RNGs move alike
        state = elastic.current()
        if state is None or not self.key:
            raise RuntimeError("an elastic loader's order was asked for outside an elastic job's epoch")
        return [int(i) for i in state.store.compare_set(f"order/{self.key}", "", drawn).decode().split(",") if i]


def epoch(loader: Any, split: Any, fresh: Callable[[], Iterator[Any]], steps: int, samples: int) -> Iterator[Any]:
    """One epoch of ``loader`` (a ShardedLoader, or a StreamShard) in elastic mode. ``split`` cuts each global
    batch (its ``rank``, ``size`` and ``resuming`` are set before each ``fresh()``, and ``latest_shares`` is
    what the iterator ``fresh()`` starts fills): the map-style loader's batch sampler, or the stream's loader
    itself, which then reads its stream again from the epoch's start."""
    state = elastic.current()
    if state is None:
        raise RuntimeError("elastic_data.epoch runs in an elastic job only (autodist run --elastic)")
    position, sampler = loader.position, split
    joining.settle(loader.elastic_model())  # a rank that joined: its optimizers take the members' state now
    resuming = position.begin(samples if samples >= 0 else None)
    number, began = position.epoch, dict(position.began)
    order: ElasticOrder | None = getattr(loader, "order", None)
    if order is not None:
        if number >= KEPT_EPOCHS:
            state.store.delete_key(f"order/{loader.watch_key}/{number - KEPT_EPOCHS}")
        order.key = f"{loader.watch_key}/{number}"
    at_commit, digest = position.taken, position.digest  # the batches every applied sync covers
    while True:
        sampler.resuming, sampler.rank, sampler.size = resuming, state.rank, state.size
        generation, seen = state.generation, state.committed
        iterator = fresh()
        batches = handed_over(iterator, sampler.latest_shares, (loader.watch_key, number, steps, samples), position)
        regrouped = False
        since: list[int] = []  # the batches (provenance ids) taken since the last applied step
        for batch in batches:
            share = provenance.current()
            if share is not None:
                since.append(share.batch)
            yield batch
            if state.committed > seen and state.generation == generation:
                at_commit, digest = position.taken, position.digest  # every batch so far is in an applied step
                since = []
            seen = state.committed
            if state.admitting:  # ranks wait to join: at this step boundary, with the state they need
                model = loader.elastic_model()
                state.admit(lambda: joining.state(model, loader_position.loaders_of(model)))
            regrouped = state.generation != generation
            if regrouped:
                abandoned.dropped(since)
                break
        batches.close()
        if not regrouped:
            return
        position.pending = {"epoch": number, "taken": at_commit, **began, "digest": digest}
        resuming = position.begin()
        if resuming is not None:
            resuming.drawn = True  # the order was drawn in this epoch already, before the generators as they are
