"""The masks of a context-parallel forward, read from the whole batch: padding, packed documents, and the mask a
model builds over this rank's tokens checked against them.

Every rank of a context-parallel group reads the same rows of each global batch and keeps its tokens
(:mod:`autodist.cp.batches`), so each holds the whole batch's tensors too. Two inputs of Hugging Face's say how
tokens may attend, and are read whole here, never from this rank's part:

* ``attention_mask`` (1 at tokens, 0 at padding): every attention masks the padded keys of the whole sequence.
* ``position_ids`` that start again within a row (packed documents, as Hugging Face's collators give them with
  ``attention_mask`` left out): the documents, numbered as Hugging Face numbers them (a new one where a position
  is not the one before plus one), which a mask the model built may confine each token to.

A mask the model builds itself (``attn_mask=``: Hugging Face's, from this rank's tokens only) is taken where it
is, over every pair of this rank's tokens, one of: causal or not, within documents or not, with the padding.
A rank's own tokens may not tell these apart (a rank whose tokens lie within one document), so where the batch
holds padding or documents the ranks agree on the kinds that fit on every one; two that still fit and differ at
a row that is a token are refused, as is a mask none fits (a padded row's output reaches no token: it is a
padded key to every row, so which a rank takes there changes nothing a token computes).

Example:
    >>> masks = Masks.of(cut, "LlamaForCausalLM", [("kwargs['attention_mask']", mask)])
    >>> masks.decide(attn_mask, False, group, device)   # (causal, documents): how the whole sequence is masked
    (True, None)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autodist.cp import refusals
from autodist.cp.batches import SequenceCut, key_of
from autodist.layers.context import attention_mask


@dataclass
class Masks:
    """What the whole batch says about attention in one forward: ``padding`` ``(rows, length)`` True at tokens
    (None: no padding), ``documents`` ``(rows, length)`` each position's document (None: one a row), and whether
    this rank's own tokens hold padding."""

    cut: SequenceCut
    name: str
    padding: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    padded_here: bool = False
    last: tuple[torch.Tensor, list[bool], int | None] | None = None  # the latest mask read and what fits it: a model passes
    # one mask to every layer (Hugging Face's), read once

    @classmethod
    def of(cls, cut: SequenceCut, name: str, tensors: list[tuple[str, torch.Tensor]],
           wholes: dict[int, torch.Tensor]) -> "Masks":
        """The masks of a forward whose input tensors are ``tensors`` (path, tensor); ``wholes``: the whole batch's
        tensor of each integer input, by id (what :meth:`SequenceCut.whole` found for them)."""
        masks = cls(cut, name)
        for path, t in tensors:
            if path.endswith("'attention_mask']") and masks._tokens(t):
                whole = masks._whole(path, t, wholes)
                if bool(((whole != 0) & (whole != 1)).any()):
                    raise NotImplementedError(
                        f"cp={cut.parts}: {name}'s input {path} holds values other than 0 and 1, so it is not a "
                        f"padding mask (Hugging Face's attention_mask); under cp a mask must be 1 at tokens, 0 at "
                        f"padding")
                if bool((whole == 0).any()):
                    masks.padding, masks.padded_here = whole.movedim(cut.dim, 1).bool(), bool((t == 0).any())
            if path.endswith("'position_ids']") and masks._tokens(t) and not t.is_floating_point():
                ids = masks._whole(path, t, wholes).movedim(cut.dim, 1)
                documents = (torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
                if bool((documents[:, -1] != 0).any()):
                    masks.documents = documents
        return masks

    def _tokens(self, t: torch.Tensor) -> bool:
        return t.ndim == 2 and t.shape[self.cut.dim] == self.cut.held

    def _whole(self, path: str, t: torch.Tensor, wholes: dict[int, torch.Tensor]) -> torch.Tensor:
        whole = wholes.get(id(t))
        if whole is None:  # a float input (no whole kept for it by the routing)
            whole = self.cut.whole(t, path)
        if whole is None:
            raise NotImplementedError(
                f"cp={self.cut.parts}: {self.name}'s input {path} (shape {list(t.shape)}) is not a cut of the batch "
                f"the loader handed out last (a part of its rows, or made anew), so the whole sequence's values "
                f"cannot be read from it; pass the batch's {key_of(path)} as the "
                f"loader gave it")
        return whole

    def decide(self, attn_mask: torch.Tensor | None, is_causal: bool, group: Any,
               device: torch.device, window: int | None = None) -> tuple[bool, torch.Tensor | None]:
        """``(causal, documents)``: how an attention call masks the whole sequence (with :attr:`padding`), from the
        mask the model built over this rank's tokens (or, with none, ``is_causal``); raises where no such mask
        fits, or two that fit differ at a token (see the module docstring). Where the batch holds padding or
        documents, the kinds that fit are agreed over the group (one small all-reduce): a rank's own tokens may
        not tell them apart, and every rank must take the same, or refuse with the others. ``window``: the
        calling layer attends within a sliding window (its attention module says so: see
        :func:`autodist.cp.forward.windows`), which the mask over this rank's tokens may show or not (Hugging
        Face leaves it out where the rank's keys are fewer than it): either fits, and the window is applied."""
        kinds = [(causal, documents) for causal in (True, False)
                 for documents in ((self.documents, None) if self.documents is not None else (None,))]
        if attn_mask is not None:
            if self.last is None or self.last[0] is not attn_mask or self.last[2] != window:
                self.last = (attn_mask, self._fits(attn_mask, kinds, window), window)
            fits = list(self.last[1])
        else:  # the model passed no mask: with padding among this rank's tokens, it does not mask the padding
            fits = [not self.padded_here and kind == (is_causal, None) for kind in kinds]
        if self.padding is not None or self.documents is not None:
            flags = torch.tensor(fits, dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
            fits = flags.bool().tolist()
        agreed = [kind for kind, fit in zip(kinds, fits) if fit]
        if agreed and not any(self._differ_at_tokens(agreed[0], other, device) for other in agreed[1:]):
            return agreed[0]
        what = "causal or not" + (", within its documents or not" if self.documents is not None else "")
        here = "a mask" if attn_mask is not None else "no mask"
        raise NotImplementedError(
            f"cp={self.cut.parts}: {self.name}'s attention at {refusals.caller()} got {here} over this rank's "
            f"{self.cut.held} tokens, and the masks the ranks' attentions got "
            f"{'fit masks that differ at a token' if agreed else 'fit no one mask'} autodist can take over the "
            f"whole sequence ({what}, with the batch's padding{'' if self.padding is not None else ': none'}); a "
            f"model that takes an attention_mask with padding must mask its attention with it. With cp the mask "
            f"must come from the whole sequence: use is_causal=True without attn_mask, Hugging Face's "
            f"attention_mask for padding, or its position_ids for packed documents (a sliding window is taken where "
            f"the attention layer names it: sliding_window, or its config's)")

    def _fits(self, attn_mask: torch.Tensor, kinds: list[tuple[bool, torch.Tensor | None]],
              window: int | None = None) -> list[bool]:
        """Which ``kinds`` of mask equal, over every pair of this rank's tokens, the mask the model built (True:
        attend; a float mask 0 there and at most half the dtype's lowest elsewhere); with ``window``, with it or
        without it."""
        held, split = self.cut.held, self.cut.split
        if attn_mask.is_floating_point():
            allowed = attn_mask == 0
            if not bool((attn_mask[~allowed] <= torch.finfo(attn_mask.dtype).min / 2).all()):
                raise NotImplementedError(
                    f"cp={self.cut.parts}: {self.name}'s attention got a float mask (attn_mask of shape "
                    f"{tuple(attn_mask.shape)}) that adds values other than 0 and the lowest to the scores (a bias, "
                    f"ALiBi): under cp only masks are taken; put a bias into the model's keys, or use cp=1")
        else:
            allowed = attn_mask
        mine = split.positions(self.cut.rank).to(attn_mask.device)
        shape = torch.broadcast_shapes(allowed.shape, (1, 1, held, held))
        windows = (None,) if window is None else (window, None)
        return [any(torch.equal(allowed.expand(shape), self._allowed(mine, mine, *kind, w).expand(shape))
                    for w in windows) for kind in kinds]

    def _differ_at_tokens(self, one: tuple, other: tuple, device: torch.device) -> bool:
        """Whether two kinds of mask differ over the whole sequence at a row that is a token (a padded row's output
        reaches no token: it is a padded key to every row); the same answer on every rank."""
        everything = torch.arange(self.cut.split.length, device=device)
        a, b = torch.broadcast_tensors(self._allowed(everything, everything, *one),
                                       self._allowed(everything, everything, *other))
        rows = (a != b).any(-1)  # (rows of the batch or 1, 1, length)
        if self.padding is not None:
            rows = rows & self.padding[:, None, :]
        return bool(rows.any())

    def _allowed(self, rows: torch.Tensor, keys: torch.Tensor, causal: bool,
                 documents: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
        """Which of ``keys`` each of ``rows`` (global positions) attends to, with the batch's padding: a bool
        tensor that broadcasts to ``(rows of the batch, 1, len(rows), len(keys))``."""
        mask = attention_mask(rows, keys, causal=causal, window=window, documents=documents,
                              key_padding=self.padding)
        if mask is None:
            return torch.ones(1, 1, len(rows), len(keys), dtype=torch.bool, device=rows.device)
        return mask if mask.ndim == 4 else mask[None, None]
