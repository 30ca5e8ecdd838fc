"""Attention written out by hand under ``cp=K`` (Hugging Face's ``eager`` attention): its scores over the whole
sequence's keys.

``softmax(q @ k^T * scale + mask) @ v`` over this rank's tokens would attend to them alone. Here the product of
two activations that is a square over the rank's tokens (``q @ k^T``) is computed against the whole
sequence's keys instead (gathered, differentiably: backward sums their gradient over the ranks and keeps this
rank's): this rank's rows of the scores, ``(..., tokens, length)``, "wide". What the model then does to them
in their shape (a scale, a softcap, ``softmax`` over the keys, ``to(dtype)``, dropout of probability 0) keeps
them wide; a mask the model built over this rank's tokens added to them (or filled in, nanoGPT's
``masked_fill(bias[:, :, :T, :T] == 0, -inf)``) is read as the routing reads one
(:mod:`autodist.cp.masks`: causal or not, within documents or not, with the batch's padding) and the whole
rows' mask added instead (0 where a key is attended, the dtype's lowest elsewhere, as Hugging Face's); and the
product of the wide weights with the values is taken with the whole sequence's values (gathered alike). Each
rank's rows are then one process's rows. Anything else done to wide scores (a reduction over the keys but the
softmax, another product) is refused, naming it.

Example:
    >>> scores = wide_scores(context, torch.matmul, (q, k.transpose(2, 3)))   # (..., tokens, length)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autodist.cp import refusals
from autodist.layers.context import attention_mask

ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})
FILLS = frozenset({torch.masked_fill, torch.Tensor.masked_fill})
SOFTMAX = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm})
KEEP = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.div,
                  torch.Tensor.div, torch.Tensor.__truediv__, torch.tanh, torch.Tensor.tanh, torch.Tensor.to,
                  torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.contiguous, F.softmax, torch.softmax,
                  torch.Tensor.softmax, F.dropout, torch.Tensor.__getitem__})

READS = frozenset({torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.is_floating_point,
                   torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
                   torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_contiguous})


def wide_scores(context: Any, func: Any, args: tuple) -> torch.Tensor:
    """``func(q, k^T)`` (a square product over this rank's tokens) over the whole sequence's keys: wide."""
    if func not in PRODUCTS or len(args) != 2:
        refusals.refuse_local_scores(context.cut.parts, context.name, func, func(*args))
    split = context.cut.split
    keys = split.gather(args[1], context.group, dim=-1)  # (..., head, length): every key of the sequence
    return remember(context, func(args[0], keys))


def remember(context: Any, scores: torch.Tensor) -> torch.Tensor:
    context.wide[id(scores)] = scores
    return scores


def on_wide(context: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on wide scores (see the module docstring): the whole rows' mask added, the values gathered, or
    the result wide again; refused otherwise."""
    parts, name, split = context.cut.parts, context.name, context.cut.split
    wide = next(a for a in args if isinstance(a, torch.Tensor) and context.wide.get(id(a)) is a)
    if func in ADDS and len(args) == 2:
        mask = args[1] if args[0] is wide else args[0]
        if isinstance(mask, torch.Tensor) and mask.shape[-1] == context.cut.held != split.length:
            return remember(context, func(wide, _whole_rows(context, mask, wide)))
    if func in FILLS and args[0] is wide:  # nanoGPT's att.masked_fill(bias[:, :, :T, :T] == 0, -inf)
        mask, value = args[1] if len(args) > 1 else kwargs["mask"], args[2] if len(args) > 2 else kwargs["value"]
        if isinstance(mask, torch.Tensor) and mask.shape[-1] == context.cut.held != split.length:
            return remember(context, func(wide, ~_allowed(context, ~mask, wide.device), value))
    if func in PRODUCTS and args[0] is wide and len(args) == 2:
        return func(wide, split.gather(args[1], context.group, dim=-2))  # per token again
    if func is F.dropout:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        if p and training:
            raise NotImplementedError(f"cp={parts}: {name}'s attention has dropout p={p} on its weights in "
                                      f"training, which would draw a different mask than one process: set attention "
                                      f"dropout to 0 under cp")
    if func in SOFTMAX:  # over the keys only: over the queries it would be over this rank's rows alone
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim % wide.ndim != wide.ndim - 1:
            raise NotImplementedError(f"cp={parts}: {name}'s attention by hand takes a softmax of its scores over "
                                      f"dimension {dim} at {refusals.caller()}, not over the keys (the last): "
                                      f"under cp a rank holds its own rows only")
    if func in KEEP or func in ADDS:
        made = func(*args, **kwargs)
        if isinstance(made, torch.Tensor) and made.shape[-1] == split.length and made.shape[-2:] == wide.shape[-2:]:
            return remember(context, made)
        return made
    if func in READS:  # its shape, dtype, device: what another mode on the stack asks (mp's)
        return func(*args, **kwargs)
    raise NotImplementedError(
        f"cp={parts}: {name}'s attention written by hand calls {getattr(func, '__name__', func)} on its scores "
        f"(this rank's rows over the whole sequence's keys under cp) at {refusals.caller()}: only scaling, masking, "
        f"softmax over the keys and the product with the values are taken; use F.scaled_dot_product_attention "
        f"(Hugging Face: attn_implementation='sdpa'), or cp=1")


def _whole_rows(context: Any, mask: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """The mask the model built over this rank's tokens (added: 0 or the lowest; or boolean, True: attend), read
    (causal or not, documents, padding), as the whole rows' additive mask: 0 where a key is attended, the dtype's
    lowest elsewhere."""
    additive = mask if mask.is_floating_point() else torch.zeros_like(mask, dtype=wide.dtype).masked_fill(
        ~mask, torch.finfo(wide.dtype).min)
    allowed = _allowed(context, additive, wide.device)
    return torch.zeros(allowed.shape, dtype=wide.dtype, device=wide.device).masked_fill(
        ~allowed, torch.finfo(wide.dtype).min)


def _allowed(context: Any, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Which keys of the whole sequence each of this rank's rows attends to (bool, broadcasting to the scores),
    from the mask the model built over its tokens (as ``F.scaled_dot_product_attention`` takes one)."""
    causal, documents = context.masks.decide(mask, False, context.group, device, context.window)
    split = context.cut.split
    mine = split.positions(context.cut.rank).to(device)
    allowed = attention_mask(mine, torch.arange(split.length, device=device), causal=causal, window=context.window,
                             documents=documents, key_padding=context.masks.padding)
    return torch.ones((), dtype=torch.bool, device=device) if allowed is None else allowed
