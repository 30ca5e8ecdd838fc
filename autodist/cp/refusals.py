"""What a context-parallel forward refuses, found as it runs: each check, and the words of each refusal.

A rank holds its own parts of each sequence, so what reaches from one token to others must go through the
routing of :mod:`autodist.cp.forward`; these are the ways a model can reach past it, each refused with the line
that did it and the fix: an op along the sequence of an input of the batch (:func:`along`: a shift of the
labels, a padding mask indexed by position), a reduction of an activation over the tokens (:func:`pools`),
another op mixing an activation's tokens (:func:`mixes`: a convolution over time, a running sum, a roll, a pad),
and attention scores written out by hand (:data:`PRODUCTS`: a square product of two activations over this rank's
tokens; under torch.compile every such product: :func:`refuse_compiled_scores`).

Example:
    >>> along(F.pad, labels, 1, ((0, 1),), {})      # Hugging Face's shift of labels=: along the sequence
    True
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

# Products of two activations: attention written out by hand (Hugging Face's "eager" attention, q @ k^T) makes a
# square of scores over this rank's tokens only, which would silently attend to them alone. A matmul or bmm of
# two is computed over the whole sequence's keys (autodist.cp.scores); the others (baddbmm, einsum) are refused.
PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
                       torch.baddbmm, torch.einsum})
# Ops that, on a tensor of the batch, can take tokens from elsewhere in the sequence (a shift, a slice, a
# running sum): with the sequence split, the neighbour of a rank's last token is on another rank.
# Reductions: along the sequence of an input (``attention_mask.sum(-1)``, the rows' lengths) computed on the whole
# batch's; along the sequence of an activation (pooling over tokens) refused: it would be over this rank's tokens.
REDUCTIONS = frozenset({torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum, torch.mean,
                        torch.Tensor.mean, torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin, torch.max,
                        torch.Tensor.max, torch.min, torch.Tensor.min, torch.any, torch.Tensor.any, torch.all,
                        torch.Tensor.all, torch.prod, torch.Tensor.prod, torch.count_nonzero,
                        torch.Tensor.count_nonzero, torch.argmax, torch.Tensor.argmax, torch.argmin,
                        torch.Tensor.argmin, torch.logsumexp, torch.Tensor.logsumexp})
PADS = frozenset({F.pad, torch._C._nn.pad})  # the second: what a compiled forward's F.pad calls (autodist.cp.compiled)
ALONG = frozenset({*PADS, torch.Tensor.__getitem__, torch.roll, torch.Tensor.roll, torch.narrow,
                    torch.Tensor.narrow, torch.cumsum, torch.Tensor.cumsum, torch.diff, torch.Tensor.diff}) | REDUCTIONS


# Ops on an activation that mix its tokens other than attention: a convolution or pooling over time (a
# (batch, channels, tokens) tensor), a running sum or product, a roll, a pad along the tokens. Under cp each rank would mix its own
# tokens only, wrong at its parts' edges and across them: refused where they reach along the rank's tokens.
WINDOWS = frozenset({torch.conv1d, torch.conv_transpose1d, torch.avg_pool1d, F.max_pool1d, torch.max_pool1d,
                     F.lp_pool1d, torch.adaptive_avg_pool1d, torch.adaptive_max_pool1d, F.adaptive_max_pool1d})
RUNNING = frozenset({torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod, torch.cummax,
                     torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin, torch.logcumsumexp,
                     torch.Tensor.logcumsumexp, torch.roll, torch.Tensor.roll})
MIXING = WINDOWS | RUNNING | PADS  # a pad along the tokens: what a causal convolution over time starts with
# what a traced forward checks: a pad there is handed to the routing's mode eagerly (autodist.cp.compiled), and
# dynamo cannot hash the pad it is told not to put in a graph (each membership test would break the graph)
MIXING_TRACED = WINDOWS | RUNNING


def mixes(func: Any, x: Any, rest: tuple, kwargs: dict, held: int, length: int) -> bool:
    """Whether ``func`` (one of :data:`MIXING`) on the float activation ``x`` (three dimensions or more: a mask
    over the tokens is not one) mixes its tokens: a window over
    time of more than one of them (the last dimension, of this rank's ``held`` tokens of ``length``), a running op,
    a roll or a pad along a dimension of ``held``. (A dimension of features as long as the rank's tokens reads as
    them: refused too; loud, not silent.)"""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.ndim >= 3 and 1 < held != length):
        return False
    if func in WINDOWS:
        if x.shape[-1] != held:
            return False
        if func in (torch.adaptive_avg_pool1d, torch.adaptive_max_pool1d, F.adaptive_max_pool1d):
            return True
        window = rest[0] if rest else kwargs.get("weight", kwargs.get("kernel_size"))
        if func in (torch.conv1d, torch.conv_transpose1d):
            return isinstance(window, torch.Tensor) and window.shape[-1] > 1
        return not (window == 1 or window == (1,) or window == [1])
    if func in PADS:
        return any(x.shape[d] == held and along(func, x, d, rest, kwargs) for d in range(x.ndim))
    if func in (torch.roll, torch.Tensor.roll):
        dims = rest[1] if len(rest) > 1 else kwargs.get("dims")
        dims = range(x.ndim) if dims is None else (dims,) if isinstance(dims, int) else dims
        return any(x.shape[d] == held for d in dims)
    dim = rest[0] if rest else kwargs.get("dim")
    return isinstance(dim, int) and x.shape[dim] == held


def refuse_mixing_activation(parts: int, name: str, func: Any, x: torch.Tensor, held: int) -> None:
    """Raise: ``func`` mixes the tokens of an activation (see :func:`mixes`)."""
    raise NotImplementedError(
        f"cp={parts}: {name}'s forward calls {getattr(func, '__name__', func)} on an activation of shape "
        f"{list(x.shape)} along this rank's {held} tokens, at {caller()}: a convolution or pooling over time (and "
        f"the pad before it), a running sum or a roll would mix this rank's parts of the sequence only, wrong at their edges: cp is built "
        f"for models whose only op across tokens is attention; train this model with cp=1")


def along(func: Any, x: torch.Tensor, dim: int, rest: tuple, kwargs: dict) -> bool:
    """Whether ``func(x, *rest, **kwargs)`` reaches along dimension ``dim`` of ``x`` (one of ``ALONG``)."""
    if func in PADS:
        pad = rest[0] if rest else kwargs["pad"]
        at = x.ndim - 1 - dim  # pad lists the last dimension first
        return 2 * at + 1 < len(pad) and (pad[2 * at] != 0 or pad[2 * at + 1] != 0)
    if func in PADS:
        return any(x.shape[d] == held and along(func, x, d, rest, kwargs) for d in range(x.ndim))
    if func in (torch.roll, torch.Tensor.roll):
        dims = rest[1] if len(rest) > 1 else kwargs.get("dims")
        return dims is None or dim in [d % x.ndim for d in ((dims,) if isinstance(dims, int) else dims)]
    if func in (torch.narrow, torch.Tensor.narrow):
        along = rest[0] if rest else kwargs["dim"]
        length = rest[2] if len(rest) > 2 else kwargs["length"]
        return along % x.ndim == dim and length != x.shape[dim]
    if func in (torch.cumsum, torch.Tensor.cumsum):
        return (rest[0] if rest else kwargs["dim"]) % x.ndim == dim
    if func in (torch.diff, torch.Tensor.diff):
        return (rest[1] if len(rest) > 1 else kwargs.get("dim", -1)) % x.ndim == dim
    if func in REDUCTIONS:
        return dim in reduced(x, rest, kwargs)
    return _indexes(rest[0], x.ndim, dim, x.shape[dim])


def reduced(x: torch.Tensor, rest: tuple, kwargs: dict) -> list[int]:
    """The dimensions of ``x`` a reduction (one of ``REDUCTIONS``) called with ``rest`` and ``kwargs`` reduces
    by name: none without a ``dim`` (a reduction of every element, a rank's term of a loss: weighed as its mean or
    sum; Hugging Face's checks of a mask, ``mask.sum() == mask.numel()``, over this rank's part, as the routing
    expects), none for ``torch.max(x, y)`` of two tensors (elementwise)."""
    if rest and isinstance(rest[0], torch.Tensor) or isinstance(kwargs.get("other"), torch.Tensor):
        return []
    dim = rest[0] if rest and not isinstance(rest[0], torch.dtype) else kwargs.get("dim", kwargs.get("axis"))
    if dim is None:
        return []
    return [d % max(x.ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim)]


def pools(x: Any, rest: tuple, kwargs: dict, dim: int, held: int, length: int) -> bool:
    """Whether a reduction reduces the sequence of an activation ``x``: a float tensor of three or more
    dimensions (``(batch, tokens, features)``) whose dimension ``dim`` holds this rank's ``held`` tokens of
    ``length``, named (pooling over tokens; a reduction of every element, a rank's loss, is not one)."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.ndim >= 3 and held != length
            and x.shape[dim % x.ndim] == held and dim % x.ndim in reduced(x, rest, kwargs)
            and not isinstance(x, torch.nn.Parameter))


def refuse_pooling(parts: int, name: str, func: Any, x: torch.Tensor) -> None:
    """Raise: ``func`` reduces an activation along the sequence (see :func:`pools`)."""
    raise NotImplementedError(
        f"cp={parts}: {name}'s forward reduces an activation of shape {list(x.shape)} along its tokens "
        f"({getattr(func, '__name__', func)} at {caller()}: pooling over the sequence), which under cp would be over "
        f"this rank's tokens only: cp is built for models whose only op across tokens is attention (causal "
        f"language models); pool outside the model (on the gathered output), or train this model with cp=1")


def _indexes(index: Any, ndim: int, dim: int, size: int) -> bool:
    """Whether ``x[index]`` picks or slices positions of dimension ``dim`` (of ``size``): anything but a slice
    of all of them there (``:``, or Hugging Face's ``[:, :q_length]`` with this rank's length)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(item is Ellipsis for item in items):
        at = next(i for i, item in enumerate(items) if item is Ellipsis)
        used = sum(1 for item in items if item is not None and item is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (ndim - used)
    items = [item for item in items if item is not None]  # a new axis indexes nothing
    if dim >= len(items):
        return False
    item = items[dim]
    return not (isinstance(item, slice) and item.indices(size) == (0, size, 1))


def refuse_compiled_scores(parts: int, name: str, func: Any) -> None:
    """Raise: attention scores written out by hand in a forward torch.compile traces (see
    :mod:`autodist.cp.compiled`)."""
    raise NotImplementedError(
        f"cp={parts}: {name} runs compiled (torch.compile) and computes attention scores by hand "
        f"({getattr(func, '__name__', func)} of two activations over this rank's tokens, at {caller()}): under "
        f"compile cp routes F.scaled_dot_product_attention only (Hugging Face: attn_implementation='sdpa'); or run "
        f"this model without torch.compile")


def caller() -> str:
    """The first frame outside torch and autodist: the model's line that called."""
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename for part in ("/torch/", "/autodist/")):
        frame = frame.f_back
    return "an unknown line" if frame is None else f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def refuse_mixing(parts: int, name: str, func: Any, path: str, x: torch.Tensor) -> None:
    """Raise: ``func`` reaches along the sequence of the input at ``path`` (see :func:`along`)."""
    if "label" in path:
        fix = ("a shift of the labels (Hugging Face's causal-LM loss pads and slices labels=) belongs in the data: "
               "shift them there and pass them as shift_labels= (Hugging Face), or compute the loss outside the "
               "model")
    elif "mask" in path:
        fix = ("a padding mask is read under cp where the model reads it at its tokens' own positions (Hugging "
               "Face's mask functions do); read otherwise (shifted, sliced, summed along), it would be this rank's "
               "part only: compute what needs the whole mask outside the model")
    else:
        fix = "compute what needs the whole sequence outside the model, or train this model with cp=1"
    raise NotImplementedError(
        f"cp={parts}: {name}'s forward calls {getattr(func, '__name__', func)} on its input {path} (or a tensor of "
        f"its shape made from it; shape {list(x.shape)}) along the sequence, at {caller()}: each rank holds its own "
        f"parts of the sequence, so a token's neighbours may be on another rank; {fix}")


def refuse_local_scores(parts: int, name: str, func: Any, made: torch.Tensor) -> None:
    """Raise: ``made``, a product of two activations, is a square over this rank's tokens (see :data:`PRODUCTS`)."""
    held = made.shape[-1]
    raise NotImplementedError(
        f"cp={parts}: {name}'s forward computes a {held} x {held} product ({getattr(func, '__name__', func)}, shape "
        f"{list(made.shape)}) at {caller()}: attention scores written out by hand over this rank's {held} tokens, "
        f"which would attend to them alone. Under cp attention written by hand must be torch.matmul(q, "
        f"k.transpose(-2, -1)) (or bmm), taken over the whole sequence; or use F.scaled_dot_product_attention "
        f"(Hugging Face: attn_implementation='sdpa')")
