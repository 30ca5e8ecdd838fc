"""What a loss is a mean over, read from its autograd graph before its backward runs.

Rank r's gradient enters the global batch's as ``(D_r / D) g_r``, where ``D_r`` is what rank r's loss divides
by and ``D`` the sum over the ranks: one process divides the whole batch's sum by ``D``. For most losses
``D_r`` is the rank's samples, which the data pipeline knows. For the losses language models train on it is
not: a cross-entropy whose labels hold ``ignore_index`` (-100: a prompt, padding) is a mean over the valid
tokens, a weighted one over the class weights of its targets, a hand-written masked mean over its mask's
count. The graph knows each: ``NllLossBackward0`` keeps the ``total_weight`` it divided by, and a sum divided
by a number keeps that number. This module walks from the loss down through what only scales or adds terms
(``loss / accumulation``, ``scaler.scale(loss)``, ``loss + aux``), stopping at each term's reduction:

* ``cross_entropy`` / ``nll_loss`` with ``reduction="mean"``: a mean over ``total_weight`` (valid targets, or
  their class weights' sum);
* a sum divided by a number (``(loss * mask).sum() / mask.sum()``, Hugging Face's ``sum / num_items_in_batch``,
  label smoothing's term): a mean over that number;
* ``x.mean()``: a mean over its elements;
* a sum of a product of a batch statistic and a batch mean, ``(f * (p.sum(0) / rows)).sum()``: the
  load-balancing loss of mixture-of-experts models (Switch Transformer's, as Hugging Face's Mixtral, Qwen-MoE
  and OLMoE compute it: ``f`` the fraction of tokens routed to each expert, no gradient; ``p`` the router's
  probabilities), a product of the batch's statistics, which the ranks must share (:class:`Balance`);
* anything else (a sum, a product, another loss function's own reduction): a term whose denominator is not
  read.

Reading costs a walk over the few nodes between the loss and its reductions and, on a GPU, one wait for the
forward to finish (the denominators are read to the host).

Example:
    >>> loss = F.cross_entropy(logits, labels)          # labels hold -100 where nothing is predicted
    >>> read([loss]).count                              # the valid labels: what this mean divides by
    37.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch

Kind = Literal["tokens", "divided", "mean", "balance", "other"]

_LIMIT = 256  # nodes visited above the reductions: a loss's own arithmetic, never the model's graph
_THROUGH = frozenset({  # one input, the same value up to shape or dtype: the term below is the term
    "NegBackward0", "ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0", "ReshapeAliasBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3",
    "UnsafeViewBackward0", "ExpandBackward0", "PermuteBackward0", "TBackward0"})
_SUMS = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1"})
_SCALES = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_MEAN, _SUM_REDUCTION = 1, 2  # torch's reduction enum as NllLossBackward keeps it


@dataclass(frozen=True)
class Term:
    """One term of a loss: its reduction and what it divides by on this rank.

    Example:
        >>> Term("tokens", 37.0, "NllLossBackward0")
    """

    kind: Kind  # "tokens": nll_loss's mean; "divided": a sum over a number; "mean": x.mean(); "other"
    denominator: float | None  # what the term divides by on this rank; None for "other"
    node: str  # the reduction's autograd node, for messages
    elements: int | None = None  # "tokens": its targets (the denominator where none is ignored or weighted)


@dataclass(frozen=True)
class Balance:
    """A load-balancing term ``sum(f * p_mean)``: where it is, and this rank's statistic ``f`` over its ``rows``.

    The one-process loss takes ``f`` and the mean of ``p`` over the whole batch's rows. A rank's gradient of it
    is ``f_global * (rows / rows_global)`` times the gradient of its own ``p`` mean: ``node`` is the product,
    whose gradient to ``p``'s side (input ``index``) the sync replaces (:mod:`autodist.dp.grad_sync`).
    """

    node: Any  # MulBackward0: f times the mean of p
    index: int  # which of its inputs carries p's gradient
    statistic: torch.Tensor  # f on this rank (detached)
    rows: float  # the rows p's mean (and f) is over on this rank


@dataclass(frozen=True)
class Reading:
    """The terms of one backward's loss, in the graph's order from its root(s).

    Example:
        >>> reading = read([loss])
        >>> reading.count      # what the first mean over tokens (or over a count) divides by; None if none
    """

    terms: tuple[Term, ...]
    balances: tuple[Balance, ...] = ()

    @property
    def counted(self) -> tuple[Term, ...]:
        """The terms that divide by a count the data does not give: tokens, a sum over a number."""
        return tuple(t for t in self.terms if t.kind in ("tokens", "divided"))

    @property
    def count(self) -> float | None:
        """This rank's ``D_r``: the first counted term's denominator (None when the loss has none, and the
        samples are what its mean is over)."""
        counted = self.counted
        return counted[0].denominator if counted else None

    def uneven(self) -> bool:
        """Whether a counted term's count is not simply its targets (some ignored, or weighted), or is a sum's
        divisor: a count that need not be proportional to the rows."""
        return any(t.elements is None or t.denominator != t.elements for t in self.counted)

    def disagreement(self) -> str | None:
        """Why one weight per rank cannot be exact for this loss, if the counted terms divide by different
        numbers here (said on the rank that sees it; every rank still takes the first term's count)."""
        counts = {t.denominator for t in self.counted}
        if len(counts) <= 1:
            return None
        listed = ", ".join(f"{t.node} over {t.denominator:g}" for t in self.counted)
        return (f"the loss adds terms that are means over different counts on this rank ({listed}); autodist "
                f"weights this rank by the first one's, so the other terms are not weighted as one process would")


@torch.compiler.disable  # it walks autograd's nodes, which dynamo cannot trace (a graph break where called)
def read(roots: Iterable[torch.Tensor]) -> Reading:
    """The terms of the loss whose backward starts at ``roots`` (the tensors ``backward()`` was called on).

    Must run before that backward: it frees the values the reductions kept.
    """
    terms: list[Term] = []
    balances: list[Balance] = []
    budget = [_LIMIT]
    for root in roots:
        if isinstance(root, torch.Tensor) and root.grad_fn is not None and root.numel() == 1:
            try:
                _walk(root.grad_fn, terms, budget, balances)
            except RuntimeError:  # a graph backward ran through already: the backward itself says so
                return Reading((Term("other", None, "(a graph already freed)"),))
    return Reading(tuple(terms), tuple(balances))


def _walk(node: Any, terms: list[Term], budget: list[int], balances: list[Balance]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        terms.append(Term("other", None, "(a loss too large to read)"))
        return
    name = type(node).__name__
    inputs = [n for n, _ in node.next_functions if n is not None]
    if name in _THROUGH and len(inputs) == 1:
        _walk(inputs[0], terms, budget, balances)
    elif name in _SUMS:
        for child in inputs:
            _walk(child, terms, budget, balances)
    elif name in _SCALES and len(inputs) == 1 and (name.startswith("Mul") or node.next_functions[0][0] is not None):
        _scaled(node, name, inputs[0], terms, budget, balances)
    else:
        balance = _balance(node) if name == "SumBackward0" else None
        if balance is not None:
            balances.append(balance)
            terms.append(Term("balance", balance.rows, "MulBackward0"))
        else:
            terms.append(_reduction(node, name))


def _scaled(node: Any, name: str, child: Any, terms: list[Term], budget: list[int], balances: list[Balance]) -> None:
    """A term multiplied or divided by a constant: a sum divided by a number is a mean over that number."""
    if name.startswith("Div") and _is_sum(child) and _balance(child) is None:
        divisor = _number(getattr(node, "_saved_other", None))
        if divisor is not None and divisor > 0:
            terms.append(Term("divided", divisor, type(child).__name__))
            return
    _walk(child, terms, budget, balances)


def _balance(total: Any) -> Balance | None:
    """``total`` (a full sum) as a load-balancing term: the sum of a no-gradient statistic times a mean over
    rows (through unsqueezes and views), ``p.sum(0) / rows`` or ``p.mean(0)``; None if it is not one."""
    product = total.next_functions[0][0] if total.next_functions else None
    if type(product).__name__ != "MulBackward0":
        return None
    sides = [n for n, _ in product.next_functions]
    if len(sides) != 2 or (sides[0] is None) == (sides[1] is None):
        return None
    index = 0 if sides[0] is not None else 1
    statistic = getattr(product, "_saved_other" if index == 0 else "_saved_self", None)
    mean = sides[index]
    for _ in range(4):  # p's mean, unsqueezed to broadcast against f
        if type(mean).__name__ not in ("UnsqueezeBackward0", "ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0"):
            break
        mean = mean.next_functions[0][0]
    name = type(mean).__name__
    rows = None
    if name == "DivBackward0" and mean.next_functions[1][0] is None:
        rows = _number(getattr(mean, "_saved_other", None))
    elif name == "MeanBackward1" and tuple(mean._saved_dim) == (0,):
        rows = float(mean._saved_self_sym_sizes[0])
    if rows is None or rows <= 0 or not isinstance(statistic, torch.Tensor):
        return None
    return Balance(product, index, statistic.detach(), rows)


def _is_sum(node: Any) -> bool:
    name = type(node).__name__
    return name == "SumBackward0" or (name in _NLL and node._saved_reduction == _SUM_REDUCTION)


def _reduction(node: Any, name: str) -> Term:
    if name in _NLL and node._saved_reduction == _MEAN:  # host sync: the forward's total_weight
        return Term("tokens", float(node._saved_total_weight), name, node._saved_target.numel())
    if name == "MeanBackward0":
        return Term("mean", float(node._saved_self_sym_numel), name)
    return Term("other", None, name)


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None  # host sync on a GPU
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
