"""Where a loader ``parallelize`` returned stands in its epochs, so that a checkpoint resumes it mid-epoch.

A position is counted in the single-process loader's global batches, whatever the number of ranks: the epoch in
progress, how many of its batches the loop has taken (the batch in hand counts as taken), and the random
generators as the epoch began (torch's global one, and the loader's and its sampler's own ``generator``). It is
rank 0's that ``autodist.save`` writes. Resuming, the loader's next epoch is that one: the generators are set
back to how it began, so the epoch draws the same order and worker seeds, its first ``taken`` global batches
are passed over (by index for a map-style dataset: no sample is loaded; a stream's are read and dropped), and
the global generator is then set back to what ``load`` restored. From there every rank takes its part of the
batches an uninterrupted run takes next, at any number of ranks.

A resume checks the data it passes over: the position holds a digest of the epoch's global batches taken (a
CRC-32 over their marks, each a CRC-32 of a batch's sample indices or of a stream batch's tensors: the mark
:mod:`autodist.dp.same_batch` compares) and the map-style dataset's length. Read again, the batches passed over
must give the same digest, and the dataset have the same length: otherwise the data changed since the save
(files appended or reordered, a shuffle seeded from the time) and the resumed run would silently go on
elsewhere than the one that saved. That is an error naming both, or with ``AUTODIST_RESUME_ANY_DATA=1`` a
warning, the run going on from the same batch number.

Example:
    >>> model, loader = autodist.parallelize(model, loader)
    >>> autodist.save("ckpt.pt", model, optimizer, step=37)      # in the epoch's loop, after 37 batches
    >>> autodist.resume("ckpt.pt", model, optimizer)              # another run: the loader goes on at batch 38
"""
from __future__ import annotations

import itertools
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from autodist.runtime.compiled import unwrapped


@dataclass
class Resuming:
    """What the first epoch after a resume passes over, and the global generator to put back after it."""

    skip: int
    then: torch.Tensor
    drawn: bool = False  # the epoch's order was drawn before ``then`` was taken: draw it before putting it back
    digest: int | None = None  # of the batches passed over, as the saving run took them (None: unknown)
    epoch: int = 0


class Position:
    """One loader's place: ``epoch`` (the one in progress, -1 before the first), ``taken`` (its global batches the
    loop has taken), ``ended`` (whether the loop took all of them), ``began`` (the generators as it began:
    ``{"rng": torch's global state, "generators": [the others' states]}``); ``generators``: the loader's and its
    sampler's own, which draw its order beside torch's global one."""

    def __init__(self, generators: Iterable[Any] = ()) -> None:
        self.generators = _distinct(generators)
        self.epoch, self.taken, self.ended = -1, 0, True
        self.began: dict[str, Any] = {}
        self.pending: dict[str, Any] | None = None
        self.digest: int | None = 0  # of the epoch's batches taken (None: a batch had no mark)
        self.length: int | None = None  # the map-style dataset's, as the epoch began

    def begin(self, length: int | None = None) -> Resuming | None:
        """An epoch begins (the loader's ``__iter__``; ``length``: its dataset's, where it has one): its number,
        and what to pass over where it resumes one."""
        saved, self.pending = self.pending, None
        if saved is None:
            self.epoch, self.taken, self.ended, self.digest, self.length = self.epoch + 1, 0, False, 0, length
            self.began = {"rng": torch.get_rng_state(), "generators": [g.get_state() for g in self.generators]}
            return None
        self.epoch, self.taken, self.ended, self.digest = saved["epoch"], saved["taken"], False, saved.get("digest")
        self.length = length
        if saved.get("length") is not None and length is not None and saved["length"] != length:
            changed(f"its dataset held {saved['length']} samples when the checkpoint was saved and holds {length} "
                    f"now", self.epoch, self.taken)
        self.began = {"rng": saved["rng"], "generators": saved["generators"]}
        then = torch.get_rng_state()
        torch.set_rng_state(saved["rng"])
        self._set(saved["generators"])
        return Resuming(self.taken, then, digest=self.digest, epoch=self.epoch)

    def took(self, mark: int | None = None) -> None:
        self.taken += 1
        self.digest = digest(self.digest, mark)

    def end(self) -> None:
        self.ended = True

    def state(self) -> dict[str, Any]:
        """For the checkpoint: the epoch in progress with its generators as it began (``rng`` set: resumed
        there, even before its first batch, whose order it drew already), or the one to begin next, ``rng``
        None, with the generators as they are."""
        if self.ended or self.epoch < 0:
            return {"epoch": self.epoch + 1, "taken": 0, "rng": None,
                    "generators": [g.get_state() for g in self.generators]}
        return {"epoch": self.epoch, "taken": self.taken, **self.began, "digest": self.digest, "length": self.length}

    def load(self, state: dict[str, Any]) -> None:
        if state["rng"] is not None:  # in an epoch: its next __iter__ resumes it
            self.pending = dict(state)
        else:  # between epochs: the next begins afresh, on the generators as they were saved
            self.epoch, self.taken, self.ended, self.pending = state["epoch"] - 1, 0, True, None
            self._set(state["generators"])

    def _set(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.generators):
            raise RuntimeError(f"the checkpoint's loader drew its order from {len(states)} generator(s) of its "
                               f"own, this one from {len(self.generators)}: build the DataLoader (its generator=, "
                               f"its sampler's) as in the run that saved it")
        for g, state in zip(self.generators, states):
            g.set_state(state)


def digest(so_far: int | None, mark: int | None) -> int | None:
    """The epoch's digest ``so_far`` with one more batch, of ``mark`` (None, for either: unknown)."""
    return None if so_far is None or mark is None else zlib.crc32(mark.to_bytes(4, "little"), so_far)


def pass_over(batches: Iterator[Any], resuming: Resuming, mark: Callable[[Any, int], int | None]) -> int:
    """Take the first ``resuming.skip`` items of ``batches``, check their digest of ``mark(item, number)`` against
    the saving run's (see the module docstring), then put the global generator back as ``load`` left it; the
    number of the next item."""
    taken, now = 0, 0
    for number, item in enumerate(itertools.islice(batches, resuming.skip)):
        taken, now = number + 1, digest(now, mark(item, number))
    if taken < resuming.skip:
        changed(f"it has {taken} batches now, and the checkpoint was saved after {resuming.skip}", resuming.epoch,
                resuming.skip)
    elif resuming.digest is not None and now is not None and now != resuming.digest:
        changed(f"its first {taken} batches read again are not the ones the checkpoint's run took (digests "
                f"{now:08x} and {resuming.digest:08x}, over each batch's CRC-32 of its sample indices or of a "
                f"stream's tensors)", resuming.epoch, resuming.skip)
    torch.set_rng_state(resuming.then)
    return taken


def changed(what: str, epoch: int, taken: int) -> None:
    """The data a resume passes over differs from the checkpoint's: raise, or where AUTODIST_RESUME_ANY_DATA=1
    is set, warn."""
    from autodist.runtime.environment import resume_any_data
    from autodist.runtime.world import log

    said = (f"resuming a loader in its epoch {epoch} after {taken} batches, as the checkpoint holds: {what}. The "
            f"data or its order changed since the save (files added, removed or reordered, a shuffle seeded from "
            f"the time or per run), so going on from batch {taken + 1} would not take the batches the saving run "
            f"took next")
    if not resume_any_data():
        raise RuntimeError(f"{said}. Resume with the data as it was, or set AUTODIST_RESUME_ANY_DATA=1 to go on "
                           f"from batch {taken + 1} of the data as it is now (docs/checkpoints.md)")
    log.warning("%s; going on from there, as AUTODIST_RESUME_ANY_DATA=1 asks", said)


def _distinct(generators: Iterable[Any]) -> list[torch.Generator]:
    out: list[torch.Generator] = []
    for g in generators:
        if isinstance(g, torch.Generator) and all(g is not h for h in out):
            out.append(g)
    return out


_loaders: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]] = weakref.WeakKeyDictionary()


def attach(model: nn.Module, loader: Any) -> None:
    """Record ``loader`` (one ``parallelize`` returned) as ``model``'s, in order, for its checkpoints."""
    if getattr(loader, "position", None) is not None:
        _loaders.setdefault(unwrapped(model), []).append(weakref.ref(loader))


def loaders_of(model: nn.Module) -> list[Any]:
    """The loaders parallelized with ``model`` and still alive, in the order they were made."""
    return [loader for ref in _loaders.get(unwrapped(model), []) if (loader := ref()) is not None]


def positions(model: nn.Module) -> list[dict[str, Any]]:
    """Where each loader parallelized with ``model`` stands, in the order they were made."""
    return [loader.position.state() for loader in loaders_of(model)]


def restore(model: nn.Module, saved: list[dict[str, Any]], where: str) -> None:
    """Give each loader parallelized with ``model`` its saved position (its next epoch resumes there)."""
    from autodist.runtime.world import log

    live = loaders_of(model)
    mid = [s for s in saved if s["rng"] is not None]
    if len(live) != len(saved) and mid:
        log.warning("%s holds the position of %d data loader(s) (%s) and %d were parallelized with this model: "
                    "%s. Pass the same loaders to parallelize, in the same order, as the run that saved it",
                    where, len(saved), ", ".join(_said(s) for s in saved), len(live),
                    "the first ones take theirs and the others start from their first batch" if live else
                    "every loop restarts its epoch from the first batch")
    for loader, state in zip(live, saved):
        loader.position.load(state)


def _said(state: dict[str, Any]) -> str:
    if state["rng"] is not None:
        return f"epoch {state['epoch']} after {state['taken']} batches"
    return f"before epoch {state['epoch']}"
