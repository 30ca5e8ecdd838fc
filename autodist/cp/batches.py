"""Each batch of a context-parallel loader cut to this rank's tokens, and the tokens a forward holds counted.

Every rank of a context-parallel group reads the same rows of each global batch (the loader shards rows over
the data-parallel ranks only); here each keeps its tokens of them: every tensor of the batch is cut along the
sequence dimension by one :class:`~autodist.layers.context.SequenceSplit` (zigzag: chunks ``r`` and ``2K-1-r``
of ``2K``), inputs and labels alike, so a per-token loss on the rank's outputs pairs each token with its own
label. The tensors of a batch must share that dimension's length (a tensor without it, a per-sample label, is
refused, naming it: it cannot be cut into tokens). The split of the batch in hand is kept for the model's
forward (:mod:`autodist.cp.forward`), which reads the positions of this rank's tokens from it.

The gradient sync weights each rank by what its loss is a mean over: read from the loss where it can be (a
cross-entropy over valid tokens: :mod:`autodist.dp.loss_reading`), otherwise by :meth:`SequenceCut.tokens`, the
rows times this rank's tokens of a forward's input, which the sync sums over the ranks.

Example:
    >>> cut = SequenceCut(rank=0, parts=2, dim=1)
    >>> x, y = cut((torch.arange(10)[None], torch.arange(10)[None]))
    >>> x.tolist()                       # chunks 0 and 3 of 3, 3, 2, 2 tokens
    [[0, 1, 2, 8, 9]]
"""
from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from autodist.layers.context import SequenceSplit
from autodist.runtime.tree import arguments, map_tensors, tensor_leaves


class SequenceCut:
    """Cuts each batch to rank ``rank``'s tokens of ``parts`` along dimension ``dim`` (1 for ``(batch, seq)``
    tensors, 0 for ``(seq, batch)``); ``split`` is the split of the latest batch cut (None before the first).

    Example:
        >>> cut = SequenceCut(rank=1, parts=2)
        >>> cut({"input_ids": ids, "labels": labels})     # each (batch, 4096) -> (batch, 2048): chunks 1 and 2
    """

    def __init__(self, rank: int, parts: int, dim: int = 1) -> None:
        self.rank, self.parts, self.dim = rank, parts, dim
        self.split: SequenceSplit | None = None
        # each cut tensor still alive (a batch in hand: a loop may take the next before it runs this one), by id:
        # (a weak reference to it, its path in the batch, the whole tensor it was cut from)
        self._wholes: dict[int, tuple[weakref.ref, str, torch.Tensor]] = {}

    @property
    def batch_dim(self) -> int:
        return 1 - self.dim

    def __call__(self, batch: Any) -> Any:
        tensors = list(tensor_leaves(batch, "batch"))
        short = [(path, tuple(t.shape)) for path, t in tensors if t.ndim <= self.dim]
        if short or not tensors:
            raise ValueError(f"cp={self.parts} cuts every tensor of a batch along dimension {self.dim} (its "
                             f"tokens), but {_named(short) if short else 'this batch holds no tensor'}: give the "
                             f"model tensors of tokens only (a per-sample value cannot be split into tokens: "
                             f"repeat it along the sequence, or compute it outside the batch)")
        lengths = {t.shape[self.dim] for _, t in tensors}
        if len(lengths) != 1:
            raise ValueError(f"cp={self.parts} cuts every tensor of a batch along dimension {self.dim} (its tokens) "
                             f"by one split, but their lengths there differ: "
                             f"{_named([(p, tuple(t.shape)) for p, t in tensors])}; pad them to one length")
        self.split = SequenceSplit(lengths.pop(), self.parts)
        split, wholes = self.split, self._wholes

        def cut(path: str, t: torch.Tensor) -> torch.Tensor:
            piece = split.split(t, self.rank, self.dim)
            key = id(piece)
            wholes[key] = (weakref.ref(piece, lambda _: wholes.pop(key, None)), path, t)
            return piece

        return map_tensors(batch, cut, "batch")

    def kept(self) -> list[torch.Tensor]:
        """The whole tensors kept for the cut ones still alive (what :func:`autodist.memory` counts)."""
        return [whole for ref, _, whole in list(self._wholes.values()) if ref() is not None]

    def whole(self, x: torch.Tensor, path: str) -> torch.Tensor | None:
        """The whole batch's tensor that ``x`` (a forward's input at ``path``) is this rank's cut of: the cut itself
        or a copy of it (moved to a device); one whose values several tensors of the batches in hand share is told
        apart by its name (``path``'s last key), else None."""
        entry = self._wholes.get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[2]
        live = [(p, piece, whole) for ref, p, whole in list(self._wholes.values()) if (piece := ref()) is not None]
        alike = [(p, whole) for p, piece, whole in live if piece.shape == x.shape and piece.dtype == x.dtype
                 and torch.equal(piece, x.to(piece.device))]
        named = [whole for p, whole in alike if key_of(p) == key_of(path)] or [whole for _, whole in alike]
        if named and all(w is named[0] or (w.shape == named[0].shape and torch.equal(w, named[0])) for w in named):
            return named[0].to(x.device)  # one, or several alike (two batches in hand, the same mask)
        return None

    @property
    def held(self) -> int:
        """This rank's tokens of each sequence of the batch in hand."""
        if self.split is None:
            raise RuntimeError("no batch was cut yet")
        return self.split.sizes[self.rank]

    def tokens(self, *args: Any, **kwargs: Any) -> int:
        """The tokens of a forward's input (the gradient sync's count): :meth:`rows` times this rank's tokens."""
        return self.rows(*args, **kwargs) * self.held

    def rows(self, *args: Any, **kwargs: Any) -> int:
        """The rows of a forward's input: of the first tensor that holds this rank's tokens of the batch in hand
        (a micro-batch of it counts its own rows); raises where none does."""
        held = self.held
        for _, value in arguments(args, kwargs):
            if isinstance(value, torch.Tensor) and value.ndim > self.dim and value.shape[self.dim] == held:
                return value.shape[self.batch_dim] if value.ndim > self.batch_dim else 1
        shapes = [(path, tuple(v.shape)) for path, v in arguments(args, kwargs) if isinstance(v, torch.Tensor)]
        raise ValueError(f"cp={self.parts}: this forward's inputs hold no tensor of this rank's {held} tokens of "
                         f"the batch in hand ({_named(shapes) or 'no tensor'}); a context-parallel model runs on "
                         f"the batches of the loader parallelize returned")


def key_of(path: str) -> str:
    """A path's last key: ``attention_mask`` of ``kwargs['attention_mask']`` or ``batch['attention_mask']``."""
    words = re.findall(r"\w+", path)
    return words[-1] if words else path


def _named(shapes: list[tuple[str, tuple[int, ...]]], limit: int = 6) -> str:
    text = ", ".join(f"{path} {list(shape)}" for path, shape in shapes[:limit])
    return text + (f" and {len(shapes) - limit} more" if len(shapes) > limit else "")
