"""What ``parallelize(model, loader, cp=K)`` would do to a model, read from one forward in this process: the cut
of the sequence (which positions each rank holds, the attention work each does) and, for every attention call
the forward makes, the bytes each rank exchanges for it in a training step.

The forward runs once on the example, whole, in this process, with ``F.scaled_dot_product_attention`` (and
``nn.MultiheadAttention``'s ``F.multi_head_attention_forward``, and scores written by hand, ``q @ k^T`` over the
tokens: :mod:`autodist.cp.scores`, whose keys and values are gathered alike) watched: each call's queries, keys
and values give its shape, and :func:`~autodist.layers.context.context_attention`
fixes the exchange. Forward, one all-gather of the keys and values (a rank puts in its tokens, padded to the
most any rank holds: gloo's all-gather takes equal shapes); backward, the gradient of the whole sequence's keys
and values summed over the ranks (one all-reduce), and, on the causal path that keeps no gathered keys
(a causal call on CPU, no mask), the same all-gather again. Grouped-query attention's keys and values are
exchanged with their own heads (repeated for the query heads after). "Sent" is what a ring moves out of each rank:
``K - 1`` contributions for an all-gather, ``2 (K - 1) / K`` of the tensor for an all-reduce. The gradient
sync of the parameters (over every rank, as data parallelism's) comes on top.

Example:
    >>> print(autodist.explain(gpt, cp=2, example=(idx,)))    # idx: (batch, tokens), one global batch's
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from autodist.cp import refusals, scores
from autodist.layers.context import SequenceSplit, fast_path
from autodist.runtime import tree


@dataclass(frozen=True)
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call of the forward: where, its query shape ``(..., tokens,
    head_dim)``, the heads its keys and values are exchanged with, their widths, the element size, and whether
    it is causal and runs the path that gathers the keys again in backward."""

    line: str
    query: tuple[int, ...]
    heads: int
    key_width: int
    value_width: int
    element: int
    causal: bool
    again: bool
    module: str = field(default="", compare=False)  # the innermost module whose forward made the call

    def contribution(self, split: SequenceSplit) -> int:
        """Bytes each rank puts into one all-gather of the keys and values: its tokens, padded to the widest."""
        return math.prod(self.query[:-3]) * self.heads * max(split.sizes) * (self.key_width + self.value_width) * self.element

    def whole(self, split: SequenceSplit) -> int:
        """Bytes of the whole sequence's keys' and values' gradient, summed over the ranks in backward."""
        return self.contribution(split) // max(split.sizes) * split.length if max(split.sizes) else 0

    def sent(self, split: SequenceSplit) -> tuple[float, float]:
        """Bytes a rank sends for this call in forward and in backward, as a ring moves them."""
        parts = split.parts
        gather = (parts - 1) * self.contribution(split)
        reduce = 2 * (parts - 1) / parts * self.whole(split)
        return float(gather), gather * self.again + reduce


@dataclass
class ContextPlan:
    """The cut of one sequence over ``parts`` ranks and the attention calls of one forward; ``print`` it for the
    table. ``sent()`` gives the bytes each rank sends in a step (forward, backward)."""

    parts: int
    length: int
    calls: list[AttentionCall] = field(default_factory=list)
    mp: int = 1
    mp_plan: Any = None  # with mp > 1: the model-parallel plan (autodist.mp's SplitPlan), printed after
    cut: Any = None  # with pp > 1: the cut into stages (autodist.pp's Cut, its stage_names()), printed after

    def stage_of(self, call: AttentionCall) -> int | None:
        """The pipeline stage whose blocks make ``call`` (None: without pp, or a call outside every block)."""
        if self.cut is None:
            return None
        return next((s for s in range(self.cut.stages) for name in self.cut.stage_names(s)
                     if call.module == name or call.module.startswith(name + ".")), None)

    def split_heads(self, mp: int, mp_plan: Any, columns: set[str]) -> "ContextPlan":
        """The plan under ``mp`` as well: a call whose module holds a column-split layer (``columns``: their
        names; its projections to q, k, v) has its heads split over the ``mp`` ranks, each exchanging its own
        over the context-parallel group; a call whose module holds none, its heads whole."""
        def split(call: AttentionCall) -> AttentionCall:
            inside = any(call.module == "" or name.startswith(call.module + ".") for name in columns)
            if not inside or call.heads % mp:
                return call
            return replace(call, heads=call.heads // mp)
        return replace(self, calls=[split(c) for c in self.calls], mp=mp, mp_plan=mp_plan)

    @property
    def split(self) -> SequenceSplit:
        return SequenceSplit(self.length, self.parts)

    def work_balance(self) -> float:
        """The most attention work (query-key pairs) a rank does over the mean (1.0: even), for the calls'
        masks (causal, or not where no call is)."""
        causal = any(c.causal for c in self.calls) or not self.calls
        work = [self.split.work(r, causal) for r in range(self.parts)]
        return max(work) / (sum(work) / len(work)) if sum(work) else 1.0

    def sent(self, stage: int | None = None) -> tuple[float, float]:
        """Bytes each rank sends for attention in a training step: (forward, backward); with pp, a rank of
        ``stage`` (its blocks' calls; None: every call, the ranks of one stage each sending their part)."""
        each = [c.sent(self.split) for c in self.calls if stage is None or self.stage_of(c) == stage]
        return sum(f for f, _ in each), sum(b for _, b in each)

    def __str__(self) -> str:
        split = self.split
        held = "; ".join(f"rank {r}: {_spans(split.held(r))} ({split.sizes[r]} tokens)" for r in range(self.parts))
        within = f", each with mp={self.mp} ranks of its own holding its heads" if self.mp > 1 else ""
        lines = [f"cp={self.parts}: each sequence of {self.length} tokens cut into {2 * self.parts} chunks, rank r "
                 f"holding chunks r and {2 * self.parts - 1}-r (zigzag){within}",
                 f"  {held}",
                 f"  attention work (query-key pairs) per rank: max/mean {self.work_balance():.3f}"]
        if not self.calls:
            lines.append("  no attention call in the forward (F.scaled_dot_product_attention, nn.MultiheadAttention, "
                         "q @ k^T over the tokens): parallelize(cp=...) refuses this model")
            return "\n".join(lines)
        lines += ["  bytes each rank sends per step for attention (ring), by call:",
                  "  | call | query (whole sequence) | keys/values exchanged | forward | backward |", "  |---|---|---|---|---|"]
        for call, group in itertools.groupby(self.calls):
            count = len(list(group))
            forward, backward = call.sent(split)
            times = f" x {count}" if count > 1 else ""
            heads = f"{call.heads} head{'s' if call.heads != 1 else ''}"
            lines.append(f"  | {call.line}{times} | {tuple(call.query)} | {heads} x "
                         f"{call.key_width}+{call.value_width}, {call.element}-byte | {_mb(forward)} | "
                         f"{_mb(backward)}{' (gathered again)' if call.again else ''} |")
        forward, backward = self.sent()
        if self.cut is None:
            lines.append(f"  total: {_mb(forward)} forward, {_mb(backward)} backward, per rank and step (the "
                         f"parameters' gradient sync comes on top)")
        else:
            for stage in range(self.cut.stages):
                forward, backward = self.sent(stage)
                lines.append(f"  stage {stage}: {_mb(forward)} forward, {_mb(backward)} backward, per rank of the "
                             f"stage and step (its blocks' calls; the parameters' gradient sync comes on top)")
        for plan in (self.cut, self.mp_plan if self.cut is None else None):
            if plan is not None:
                lines += ["", str(plan)]
        return "\n".join(lines)


def _spans(chunks: list[tuple[int, int]]) -> str:
    return ", ".join(f"{lo}-{hi - 1}" if hi > lo else "none" for lo, hi in chunks)


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n < 1e7 else f"{n / 1e6:.0f} MB"


class _Watch(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call of a forward (``nn.MultiheadAttention``'s, and scores
    written by hand over ``length`` tokens), and runs it."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []
        self.length = length
        self.modules: list[str] = [""]  # the forwards running now, innermost last

    def watch(self, model: nn.Module) -> list[Any]:
        """Hooks that keep :attr:`modules` (removed by the caller)."""
        def ended(module: nn.Module, args: tuple, output: Any) -> None:
            self.modules.pop()

        handles = []
        for name, module in model.named_modules():
            if name:
                handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self.modules.append(name)))
                handles.append(module.register_forward_hook(ended, always_call=True))
        return handles

    def _add(self, call: AttentionCall) -> None:
        self.calls.append(replace(call, module=self.modules[-1]))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.record(*args, **kwargs)
        if func is F.multi_head_attention_forward:  # its attention inside is not seen again (the mode is off)
            self.record_multihead(*args, **kwargs)
        if func in scores.PRODUCTS and len(args) == 2 and self._scores(*args):
            self.record_scores(*args)
        return func(*args, **kwargs)

    def _scores(self, a: Any, b: Any) -> bool:
        """Whether ``a @ b`` is attention scores written by hand: two activations, a square over the tokens."""
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim >= 3 and b.ndim >= 3
                and not isinstance(a, nn.Parameter) and not isinstance(b, nn.Parameter)
                and a.shape[-2] == b.shape[-1] == self.length and a.shape[-1] == b.shape[-2])

    def record_scores(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """``q @ k^T`` (Hugging Face's eager attention): its keys and, for the product with the weights, its
        values (as wide as the keys) gathered, as :mod:`autodist.cp.scores` gathers them."""
        heads = query.shape[-3]
        self._add(AttentionCall(refusals.caller(), tuple(query.shape), heads, query.shape[-1],
                                        query.shape[-1], query.element_size(), True, False))

    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> None:
        heads = key.shape[-3] if key.ndim >= 3 else 1  # grouped-query attention: the key heads are exchanged
        self._add(AttentionCall(
            refusals.caller(), tuple(query.shape), heads, key.shape[-1], value.shape[-1], key.element_size(),
            bool(is_causal), bool(is_causal) and attn_mask is None and fast_path(query, key, value)))


    def record_multihead(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim: int,
                         num_heads: int, *args: Any, key_padding_mask: Any = None, need_weights: bool = True,
                         attn_mask: Any = None, is_causal: bool = False, **kwargs: Any) -> None:
        """An ``nn.MultiheadAttention`` call (``F.multi_head_attention_forward``, ``(tokens, batch, embed)``): its
        heads' keys and values exchanged as :mod:`autodist.cp.multihead` exchanges them."""
        tokens, rows = query.shape[0], query.shape[1] if query.ndim == 3 else 1
        head = embed_dim // num_heads
        causal = attn_mask is not None  # taken where it is causal over a rank's tokens (else refused)
        trusted = is_causal and key_padding_mask is None and not need_weights  # torch drops attn_mask here
        q = query.new_empty(()).expand(rows, num_heads, tokens, head)  # its shape, no memory
        self._add(AttentionCall(
            refusals.caller(), tuple(q.shape), num_heads, head, head, query.element_size(), causal,
            trusted and fast_path(q, q, q)))


def explain(model: nn.Module, parts: int, example: Any) -> ContextPlan:
    """The plan of ``parallelize(model, loader, cp=parts)`` for ``example`` (one forward's arguments, the whole
    sequence: a tuple of positional ones, a dict of keyword ones, or one tensor), read by running that forward
    once here, without gradients (no process group needed). The length is the first attention call's.

    Example:
        >>> plan = explain(gpt, 2, (idx,))
        >>> plan.sent()                          # bytes a rank sends for attention per step: (forward, backward)
    """
    first = next((x.shape[1] for _, x in tree.tensor_leaves(example, "example") if x.ndim >= 2), 0)
    watch = _Watch(first)  # the tokens: the first token tensor's dimension 1
    handles = watch.watch(model)
    try:
        with torch.no_grad(), watch:
            tree.call(model, example)
    finally:
        for handle in handles:
            handle.remove()
    return ContextPlan(parts, watch.calls[0].query[-2] if watch.calls else first, watch.calls)
