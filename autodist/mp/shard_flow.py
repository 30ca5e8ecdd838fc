"""How a tensor split along one dimension flows through the ops between split layers.

A column-split layer hands each rank a slice of its output features (for a
fused QKV projection: its heads of q, of k and of v). Between that layer and
the row-split one, the model's own code runs on the slice: ``split``,
``view(B, T, n_head, head_dim)``, ``transpose``, attention, ``view(B, T, C)``.
:class:`Flow`, a ``TorchFunctionMode``, follows which dimension of each tensor
is split through those ops, and does two jobs:

- **planning** (``local=False``): on the single-process model, it follows the
  outputs of every candidate layer and finds where they go. A layer whose
  output reaches other layers' inputs (split on the last dimension) only
  through ops that work on a slice - elementwise ops, reshapes that keep the
  split dimension outermost, transposes, attention over a split head
  dimension, softmax over another dimension - can be split; anything else
  (a reduction or softmax over the split dimension, a mix with an unsplit tensor of the same width, the model's output) names
  the op and line that keeps it whole.
- **running** (``local=True``): on each rank, it rewrites the size arguments
  of those ops from the model's sizes to the slice's (``view(B, T, 12, 64)``
  becomes ``view(B, T, 6, 64)``, ``split(768)`` becomes ``split(384)``); code
  that computes sizes from the tensor itself (``view(B, T, -1, hd)``) needs
  nothing. Dropout on a slice multiplies by the slice of the mask one
  process would draw for the whole tensor (drawn from the RNG the group
  shares), so the split run drops what one process drops.

It works above autograd, so backward sees the rewritten ops. What it cannot
follow raises (running) or keeps the layers whole (planning), never a silent
reinterpretation.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from autodist.mp.observe import model_line
from autodist.mp.split_ops import PASSING, RULES, Split, Unsupported, broadcast_split

__all__ = ["Flow", "Split", "Unsupported"]


def _name(func: Callable) -> str:
    """A stable name for a function the mode sees: "Tensor.view", "torch.split", "F.softmax", "Tensor.shape"."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # a property read: x.shape, x.mT
        return f"Tensor.{owner.__name__}"
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", None) or ""
    head, _, tail = qual.rpartition(".")
    if head in ("TensorBase", "Tensor", "_TensorBase"):
        return f"Tensor.{tail}"
    if module.startswith("torch.nn.functional"):
        return f"F.{tail}"
    if head == "_VariableFunctionsClass" or module.startswith("torch._C") or module in ("torch", "torch.functional"):
        return f"torch.{tail}"
    return f"{module}.{qual}"


class Flow(TorchFunctionMode):
    """Follow split tensors through the ops of a forward (see the module docstring).

    Example:
        >>> flow = Flow(parts=2, local=False)
        >>> with flow:
        ...     y = model(x)        # after flow.tag(...) on candidate outputs, from module hooks
    """

    def __init__(self, parts: int, local: bool, rank: int = 0, group: Any = None) -> None:
        super().__init__()
        self.parts, self.local, self.rank, self.group = parts, local, rank, group
        self.splits: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> Split
        self.sources: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> frozenset of layer names (planning)
        self.failed: dict[str, str] = {}  # layer name -> why its output cannot stay split (planning)
        self.decided: dict[str, tuple[int, ...]] = {}  # layer name -> blocks of its output (planning)
        self.structural: set[str] = set()  # layers whose output met an op other than an elementwise one
        self.opaque = 0  # > 0 inside a split layer: its own ops are its business
        self.elementwise: set[str] = set()  # functions found elementwise (planning) / allowed as such (running)
        # planning: the layers behind each op that cut a per-head tensor needing a gradient (its backward
        # all-gathers the parts' gradients)
        self.cuts: list[frozenset[str]] = []

    # -- bookkeeping ---------------------------------------------------------------------------------

    def tag(self, tensor: torch.Tensor, split: Split, sources: frozenset[str] = frozenset()) -> None:
        self.splits[tensor] = split
        if sources:
            self.sources[tensor] = sources

    def split_of(self, tensor: Any) -> Split | None:
        return self.splits.get(tensor) if isinstance(tensor, torch.Tensor) else None

    def _sources_of(self, tensors: list[torch.Tensor]) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in tensors:
            out |= self.sources.get(t, frozenset())
        return out

    def fail(self, tensors: list[torch.Tensor], why: str) -> None:
        for name in self._sources_of(tensors):
            self.failed.setdefault(name, why)

    def decide(self, tensors: list[torch.Tensor], blocks: tuple[int, ...]) -> None:
        """Planning: the output of the layers behind ``tensors`` turned out to hold these blocks."""
        for name in self._sources_of(tensors):
            if self.decided.setdefault(name, blocks) != blocks:
                raise Unsupported(f"its output is split into blocks {list(blocks)} here and "
                                  f"{list(self.decided[name])} elsewhere")

    def cut(self, args: tuple, kwargs: dict, cut: list[tuple[torch.Tensor, int]], split: Split,
            split_in: list[torch.Tensor]) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with each unsplit tensor of ``cut`` (a per-head tensor held whole) replaced by
        this rank's part along its dimension (running); planning notes that the op cuts one."""
        if not cut:
            return args, kwargs
        self.structural |= self._sources_of(split_in)  # running must make the cut
        if not self.local:
            if any(t.requires_grad for t, _ in cut):
                self.cuts.append(self._sources_of(split_in))
            return args, kwargs
        from autodist.layers.shard import Shard, take_replicated

        parts = {id(t): take_replicated(t, Shard.even(tuple(t.shape), own, split.blocks, self.parts, self.rank,
                                                      self.group)) for t, own in cut}
        swap = lambda x: parts.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tree_map(swap, args), tree_map(swap, kwargs)

    def full_size(self, t: torch.Tensor, split: Split) -> int:
        """The single-process size of the split dimension."""
        if not self.local or split.blocks is None:
            return t.shape[split.dim]
        return sum(split.blocks)

    def full_shape(self, t: torch.Tensor, split: Split) -> list[int]:
        shape = list(t.shape)
        shape[split.dim] = self.full_size(t, split)
        return shape

    def local_width(self, blocks: tuple[int, ...]) -> int:
        return sum(b // self.parts for b in blocks)

    # -- the mode ------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.opaque:
            return func(*args, **kwargs)
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        split_in = [t for t in flat if t in self.splits]
        if not split_in:
            return func(*args, **kwargs)
        name = _name(func)
        rule = RULES.get(name)
        try:
            if rule is None:
                return self._elementwise_call(func, name, args, kwargs, flat, split_in)
            local_args, local_kwargs, splits, call = rule(self, func, args, kwargs)
            if rule not in PASSING or call is not None:  # it moves or resizes the split dimension, or runs
                # another function on the slice: running must follow it
                self.structural |= self._sources_of(split_in)
            if self.local:  # planning runs the model's own op on the whole tensors
                args, kwargs, func = local_args, local_kwargs, call or func
        except Unsupported as err:
            where = model_line()
            why = f"{name} {err}" + (f" at {where}" if where else "")
            if self.local:
                raise RuntimeError(f"model parallelism: {why}; the plan was made from a forward that did not run "
                                   f"this; pass parallelize(..., mp_layers=[...]) without these layers") from None
            self.fail(split_in, why)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        sources = self._sources_of(split_in)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for o, split in zip(outs, splits if isinstance(splits, list) else [splits] * len(outs)):
            if split is not None:
                self.tag(o, split, sources)
        return out

    def _elementwise_call(self, func, name, args, kwargs, flat, split_in):  # type: ignore[no-untyped-def]
        """An op with no rule: elementwise with broadcasting if (planning) every aten op it runs is, and it
        returns the broadcast shape; while running, only functions the plan found so are let through."""
        if name in _NOT_TENSORS:
            return func(*args, **kwargs)
        if self.local and name not in self.elementwise:
            raise Unsupported("is not an op the plan saw on a split tensor")
        out_ndim = max(t.dim() for t in flat)
        split, cut = broadcast_split(self, flat, split_in, out_ndim)
        args, kwargs = self.cut(args, kwargs, cut, split, split_in)
        if self.local:
            out = func(*args, **kwargs)
        else:
            with _AtenTags() as seen:
                out = func(*args, **kwargs)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            shape = torch.broadcast_shapes(*(t.shape for t in flat))
            if not seen.pointwise or not outs or any(o.shape != shape for o in outs):
                raise Unsupported("is not elementwise on the split dimension")
            self.elementwise.add(name)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.dim() == out_ndim:
                self.tag(o, split, self._sources_of(split_in))
        return out


_NOT_TENSORS = {"Tensor.size", "Tensor.dim", "Tensor.numel", "Tensor.shape", "Tensor.dtype", "Tensor.device",
                "Tensor.requires_grad", "Tensor.is_contiguous", "Tensor.stride", "Tensor.ndim", "Tensor.grad_fn",
                "Tensor.data_ptr", "Tensor.element_size", "Tensor.is_floating_point", "Tensor.__len__",
                "Tensor.is_cuda", "Tensor.layout", "Tensor.__hash__", "Tensor.ndimension", "Tensor.nelement",
                "Tensor.is_leaf", "Tensor.grad", "Tensor.names", "Tensor.is_complex", "Tensor.get_device"}


class _AtenTags(TorchDispatchMode):
    """Whether every aten op run inside is tagged pointwise (or only copies/aliases): ``pointwise``."""

    _ALLOWED = {"aten.detach.default", "aten.alias.default", "aten.clone.default", "aten._to_copy.default",
                "aten.expand.default", "aten.view.default", "aten._unsafe_view.default", "aten.lift_fresh.default"}

    def __init__(self) -> None:
        super().__init__()
        self.pointwise = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch.Tag.pointwise not in func.tags and str(func) not in self._ALLOWED:
            self.pointwise = False
        return func(*args, **(kwargs or {}))


