"""A context-parallel model's forward: its attention over the whole sequence and its positions the global ones.

Each rank runs the model on its tokens of each sequence (:mod:`autodist.cp.batches`). What in a transformer's
forward depends on where those tokens stand in the whole sequence is met as the forward runs, by a torch
function mode the model's forward puts on the stack (and takes off when it returns or raises):

* ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` (nanoGPT's, Hugging Face's ``sdpa`` attention):
  each rank's queries attend to the whole sequence's keys, through
  :func:`~autodist.layers.context.context_attention` over the context-parallel group; grouped-query attention
  (``enable_gqa=True``) exchanges the keys and values with their own heads, repeated after. Attention dropout
  in training, and attention whose keys are not this rank's tokens (a cache, cross-attention), are refused.
  torch's ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) alike (:mod:`autodist.cp.multihead`).
* Masks (:mod:`autodist.cp.masks`): the whole batch's padding (an input named ``attention_mask``) and packed
  documents (``position_ids`` that start again within a row), read whole; a mask the model builds over this
  rank's tokens (``attn_mask=``) taken where it is one of those over its tokens, agreed over the group.
* An op along the sequence on an integer input of the batch (Hugging Face's ``position_ids[:, :1]``, its
  ``torch.diff`` and ``cumsum`` finding packed documents) is computed on the whole batch's, which every rank of
  the group holds, and, where it has a value for each token, cut to this rank's; an index of this rank's global
  positions (``padding_mask[batch, kv_idx]``) reads its part. Along the sequence of anything else (a float
  input, a shift of the labels) it is refused.
* ``torch.arange(start, start + n)`` with ``n`` this rank's tokens (nanoGPT's ``pos``, Hugging Face's
  ``cache_position``, from which its ``position_ids`` and rotary tables come) becomes ``start`` plus the
  global positions of this rank's tokens. An ``arange`` of that length could also number something else: it is
  refused where the batch's rows are as many (which one it is cannot be told apart), and the first one replaced
  is logged with the line that called it.
* ``torch.diff`` of those positions reads them as consecutive: Hugging Face, for a batch of one sequence,
  looks for packed documents where the positions jump, and a rank's jump once, from its first chunk to its
  second, within one sequence.

A block run again in backward (``checkpoint=True``'s: :meth:`Context.again`; or the model's own
``torch.utils.checkpoint``, met by a pre-hook on every submodule that finds autograd's backward running and no
routing on the stack) is routed as it was the first time.

What would reach past this routing is refused (:mod:`autodist.cp.refusals`). Every other op works on each token
alone in the transformers this is for (linear layers, norms, activations, embeddings); an op on activations
mixing along the sequence is refused where it is a pooling, a convolution over time, a running op, a roll or a
pad (:func:`refusals.mixes`), not where it is a slice or an index (docs/context-parallel.md). Under
torch.compile the same routing runs, split into what stays in the graphs and what runs eagerly
(:mod:`autodist.cp.compiled`).

Example:
    >>> attach(model, cut, group, sync.global_units())      # parallelize(model, loader, cp=K) does this
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from autodist.cp import refusals, scores
from autodist.cp.batches import SequenceCut
from autodist.cp.compiled import (compiled_layers, eagerly, in_compiled_region, older_torch, refuse_float_inputs,
                                  refuse_layout, refuse_older_torch, refuse_own_checkpointing, see_pads, skip_frames,
                                  traced, warn_eager)
from autodist.cp.masks import Masks
from autodist.cp.multihead import multihead
from autodist.layers.context import context_attention
from autodist.runtime.held import Held
from autodist.runtime.tree import arguments
from autodist.runtime.units import scaled_outputs

log = logging.getLogger("autodist")


class _Routes(TorchFunctionMode):
    """The mode on the stack during a context-parallel forward."""

    def __init__(self, context: "Context") -> None:
        super().__init__()
        self.context = context

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.compiler.is_compiling():  # dynamo traces this: what the trace cannot decide runs eagerly
            return traced(self.context, func, args, kwargs or {})
        if in_compiled_region():  # eagerly, between a compiled forward's graphs: no frame of it compiled
            return eagerly(self.context, func, args, kwargs or {}, compiled=True)
        return self.context.route(func, args, kwargs or {})


skip_frames(_Routes.__torch_function__)  # called eagerly (between a compiled forward's graphs): not a frame to trace


class Context:
    """One context-parallel model's routing: the cut of its batches, the group sharing each sequence."""

    def __init__(self, cut: SequenceCut, group: Any, name: str, scale: Callable[[], float]) -> None:
        self.cut, self.group, self.name, self.scale = cut, group, name, scale
        self.mode: _Routes | None = None  # on the stack while a forward runs: self.routes, or None
        self.routes = _Routes(self)  # the one object each forward puts there (dynamo guards on the mode stack)
        self.recomputing: nn.Module | None = None  # the submodule run again in backward that put the mode there
        self.window: int | None = None  # the sliding window of the attention layer running now (windows())
        self.not_compiled_with: list[str] = []  # what this layout has that a compiled forward is not built with
        self.warned_eager = False
        self.logged = False
        self.routed = 0  # attention calls routed in the forward running now
        self.micro_batches = 0  # pp's micro-batches of the forward running now (or last run)
        # under pp with padding or documents: each block input's micro-batch (masks, rows), by its storage
        self.first_runs: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, Masks, int]] = {}
        self.recompute_saved: tuple[Masks, int] | None = None
        self.recomputed_task: tuple[int, tuple[weakref.ref, Masks, int]] | None = None  # the backward running now:
        # the micro-batch its first recomputed submodule was found in
        self.rows = 0  # the batch's rows in the forward running now
        self.rows_of_data = (0, 1)  # (data-parallel index, their number): how a loader's rows are sharded
        self.inputs: dict[int, str] = {}  # the forward's inputs of this rank's tokens, by id: their paths
        self.masks = Masks(cut, self.name)  # the whole batch's padding and documents: kept for a block run again
        self.held_inputs: list[torch.Tensor] = []  # kept alive while the forward runs, so the ids stay theirs
        self.wholes: dict[int, torch.Tensor] = {}  # the whole batch's value of each integer input (and of what is
        # made from them in their shape), by the id of this rank's part
        # attention scores written by hand, over the whole sequence's keys, by id (weakly: not kept past autograd)
        self.wide: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def held(self) -> Held:
        """What the routing keeps between steps (:func:`autodist.memory`'s "autodist buffers"): the whole batches in
        hand, from which their padding, documents and integer inputs are read, and the masks kept for a block run
        again in backward."""
        held = Held()
        held.add("autodist buffers", *self.cut.kept(), self.masks.padding, self.masks.documents)
        return held

    # -- the forward's bounds ------------------------------------------------------------------------------------
    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # traced: what follows runs eagerly, a break in the graph
            return self._enter_eagerly(module, args, kwargs)
        self._enter(module, args, kwargs, compiled=in_compiled_region())  # run eagerly inside a compiled call?

    @torch.compiler.disable
    def _enter_eagerly(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._enter(module, args, kwargs, compiled=True)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict, compiled: bool) -> None:
        """The forward's routing on the stack: ``compiled``, the mode torch.compile can trace
        (:mod:`autodist.cp.compiled`)."""
        if self.mode is not None:  # a forward inside this model's own (a model calling itself): already routed
            return
        if self.cut.split is None:
            raise RuntimeError(f"cp={self.cut.parts}: {self.name} ran before the loader parallelize returned handed "
                               f"out a batch; a context-parallel model runs on that loader's batches, each cut to "
                               f"this rank's tokens")
        if compiled and self.not_compiled_with:
            refuse_layout(self.cut.parts, self.name, self.not_compiled_with)
        if compiled and older_torch():
            refuse_older_torch(self.cut.parts, self.name)
        if compiled and getattr(module, "is_gradient_checkpointing", False):
            refuse_own_checkpointing(self.cut.parts, self.name)
        if not compiled and self.not_compiled_with and not self.warned_eager:  # once: a layer compiled by itself?
            self.warned_eager = True
            layers = compiled_layers(module)
            if layers:
                warn_eager(self.cut.parts, self.name, self.not_compiled_with, layers)
        self.rows = self.cut.rows(*args, **kwargs)  # raises where no input holds this rank's tokens of the batch
        held = self.cut.held
        tensors = [(path, t) for path, t in arguments(args, kwargs) if isinstance(t, torch.Tensor)]
        self.inputs = {id(t): path for path, t in tensors if t.ndim > self.cut.dim and t.shape[self.cut.dim] == held}
        self.held_inputs = [t for _, t in tensors]  # alive until leave: their ids stay theirs
        self.wholes = {id(t): whole for path, t in tensors if id(t) in self.inputs and not t.is_floating_point()
                       and (whole := self.cut.whole(t, path)) is not None}
        self.masks = Masks.of(self.cut, self.name, tensors, self.wholes)
        if compiled:
            floats = [path for path, t in tensors if id(t) in self.inputs and t.is_floating_point()]
            if floats:
                self.inputs, self.held_inputs, self.wholes = {}, [], {}
                refuse_float_inputs(self.cut.parts, self.name, floats)
        self.routed = self.micro_batches = 0
        self.mode = self.routes
        self.mode.__enter__()

    @torch.compiler.disable  # under torch.compile: a break in the graph, as the forward began
    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """The mode off the stack (before the gradient sync's hook, which may put its own there), and each output
        that carries a gradient replaced by one whose gradient is multiplied by ``scale()``: once per path from
        the loss, even where one output is computed from another inside the model (nanoGPT's loss from its
        logits), and asked when the sync, whose hooks are on the replacements, has weighed the backward."""
        mode, self.mode = self.mode, None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        self.inputs, self.held_inputs, self.wholes = {}, [], {}
        self.masks.last = None  # the model's mask: not kept past its forward
        if self.routed == 0:
            raise NotImplementedError(
                f"cp={self.cut.parts}: {self.name}'s forward ran no attention autodist could route over the whole "
                f"sequence: its attention is not F.scaled_dot_product_attention (a kernel of its own, flash-attn, "
                f"xformers). Each rank would attend to its own tokens only, so nothing is trained this way")
        if not torch.is_grad_enabled():
            return None
        return scaled_outputs(output, self.scale)

    def again(self) -> contextlib.AbstractContextManager:
        """The routing for a block's forward run again in backward (``checkpoint=True``), asked as the block
        first runs (torch's checkpoint asks for it then): the masks and rows of the forward running now (under pp,
        its micro-batch's), put back when backward runs the block again, after the model's forward has ended."""
        return self._again(self.masks, self.rows)

    @contextlib.contextmanager
    def _again(self, masks: Masks, rows: int) -> Iterator[None]:
        saved, (self.masks, self.rows) = (self.masks, self.rows), (masks, rows)
        # recomputed inside a forward (nested checkpointing; pp's 1F1B, a micro-batch's backward amid the
        # others' forwards): already routed, with its own masks meanwhile
        mode = None if self.mode is not None else self.routes
        if mode is not None:
            self.mode = mode
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                self.mode = None
                mode.__exit__(None, None, None)
            self.masks, self.rows = saved

    @contextlib.contextmanager
    def micro(self, args: tuple, kwargs: dict, start: int) -> Iterator[None]:
        """One micro-batch of the forward running now (pp's): the batch's rows ``start`` on, whose tensors
        (``args``, ``kwargs``: the forward's arguments cut along the rows, at the same paths) are read as the
        forward's inputs while it runs, the whole batch's of each its rows of the whole, its masks theirs."""
        if self.mode is None:  # no routed forward running
            yield
            return
        saved = self.inputs, self.wholes, self.masks, self.rows, self.held_inputs
        batch = {self.inputs[id(t)]: t for t in self.held_inputs if id(t) in self.inputs}
        rows_dim, held = self.cut.batch_dim, self.cut.held
        tensors = [(path, t) for path, t in arguments(args, kwargs) if isinstance(t, torch.Tensor)]
        inputs, wholes = {}, {}
        for path, t in tensors:
            whole = path in batch and t.ndim > max(self.cut.dim, rows_dim) and t.shape[self.cut.dim] == held
            if whole:
                inputs[id(t)] = path
                if id(batch[path]) in self.wholes:
                    wholes[id(t)] = self.wholes[id(batch[path])].narrow(rows_dim, start, t.shape[rows_dim])
        self.micro_batches += 1
        self.inputs, self.wholes, self.held_inputs = inputs, wholes, [*saved[4], *(t for _, t in tensors)]
        self.masks, self.rows = Masks.of(self.cut, self.name, tensors, wholes), self.cut.rows(*args, **kwargs)
        try:
            yield
        finally:
            self.inputs, self.wholes, self.masks, self.rows, self.held_inputs = saved

    def recomputed_begins(self, module: nn.Module, args: tuple) -> None:
        """A submodule's forward run in backward with no routing on the stack: a block the model checkpoints
        itself (``torch.utils.checkpoint`` in its code, Hugging Face's ``gradient_checkpointing_enable()``), run
        again by autograd after the model's forward returned; routed as it was the first time, until it ends.
        Under pp, with padding or documents, each micro-batch's are found again by the block's input (the same
        storage: torch's checkpoint keeps it, detached or not), as its first run inside the micro-batch kept them."""
        masked = self.masks.padding is not None or self.masks.documents is not None
        if self.mode is not None:  # a first run (or one inside a forward): kept where a micro-batch's masks vary
            if self.micro_batches and args and isinstance(args[0], torch.Tensor) and not _in_backward():
                self._first_runs(args[0])
            return
        varied = self.micro_batches > 1 and masked
        if not _in_backward():
            return
        saved = (self.masks, self.rows)
        if varied:
            found = self.first_runs.get(_storage_of(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            task = torch._C._current_graph_task_id()
            if found is not None and found[0]() is not None:
                self.recomputed_task = (task, found)
            elif self.recomputed_task is not None and self.recomputed_task[0] == task:
                found = self.recomputed_task[1]  # a submodule after the first of a block (its inputs by name)
            else:
                raise NotImplementedError(
                    f"cp={self.cut.parts}: {self.name} checkpoints its own blocks ({type(module).__name__} run again "
                    f"in backward) on an input autodist did not see it run on, and under pp each micro-batch has "
                    f"its own padding or documents: use parallelize(..., checkpoint=True) instead of the model's "
                    f"own (Hugging Face: gradient_checkpointing_disable())")
            self.masks, self.rows = found[1], found[2]
        self.mode, self.recomputing, self.recompute_saved = self.routes, module, saved
        self.mode.__enter__()

    def _first_runs(self, x: torch.Tensor) -> None:
        """The masks and rows of the micro-batch running now, kept for a block run again on ``x`` in backward (none
        for a block another pipeline stage runs: its input here holds no values, and reading where raises)."""
        try:
            key, runs = _storage_of(x), self.first_runs
        except RuntimeError:
            return

        def gone(ref: weakref.ref) -> None:  # its entry only: a later tensor may have taken the same storage
            if runs.get(key, (None,))[0] is ref:
                del runs[key]
        runs[key] = (weakref.ref(x, gone), self.masks, self.rows)

    def recomputed_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.recomputing is module:
            mode, self.mode, self.recomputing = self.mode, None, None
            mode.__exit__(None, None, None)
            self.masks, self.rows = self.recompute_saved

    def reaches_along(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` on an input of the batch reaches along the sequence (see :func:`refusals.along`)."""
        x = args[0]
        return refusals.along(func, x, self.cut.dim % x.ndim, args[1:], kwargs)

    def pools(self, args: tuple, kwargs: dict) -> bool:
        """Whether a reduction reduces an activation over this rank's tokens (see :func:`refusals.pools`)."""
        return refusals.pools(args[0], args[1:], kwargs, self.cut.dim, self.cut.held, self.cut.split.length)

    def mixes(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` (one of ``refusals.MIXING``) mixes an activation's tokens (see
        :func:`refusals.mixes`)."""
        return refusals.mixes(func, args[0], args[1:], kwargs, self.cut.held, self.cut.split.length)

    def refuse_mixing(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Raise: ``func`` on an input of the batch reaches along the sequence, and its whole is not at hand."""
        refusals.refuse_mixing(self.cut.parts, self.name, func, self.inputs[id(args[0])], args[0])

    def from_whole(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func``, which reaches along the sequence of an integer input, computed as one process computes it,
        on the whole batch's (every rank of the group holds it): where the result has a value for each token of
        the sequence, this rank's tokens of it (an input too); else the whole result (Hugging Face's
        ``position_ids[:, :1]``). ``NotImplemented`` where a tensor of the call has no whole at hand (a float
        activation, a label: a shift of the labels stays refused)."""
        if "label" in self.inputs[id(args[0])]:
            return NotImplemented
        swapped = self._swapped(args, kwargs)
        if swapped is None:
            return NotImplemented
        made = func(*swapped[0], **swapped[1])
        if not isinstance(made, torch.Tensor):
            return NotImplemented
        dim, split = self.cut.dim % args[0].ndim, self.cut.split
        if made.ndim <= dim or made.shape[dim] != split.length:
            return made
        mine = split.split(made, self.cut.rank, dim)
        self.inputs[id(mine)] = self.inputs[id(args[0])]
        self.held_inputs.append(mine)
        self.wholes[id(mine)] = made
        return mine

    def _swapped(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``args`` and ``kwargs`` with each input of the batch replaced by its whole; None where one has none, or
        where another tensor holds this rank's tokens only (an activation)."""
        dim, held = self.cut.dim, self.cut.held

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if id(value) in self.inputs:
                    whole = self.wholes.get(id(value))
                    if whole is None:
                        raise LookupError
                    return whole
                if value.ndim > dim and value.shape[dim] == held and held != self.cut.split.length:
                    raise LookupError
            if isinstance(value, (tuple, list)):
                return type(value)(swap(v) for v in value)
            return value

        try:
            return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
        except LookupError:
            return None

    def local_scores(self, args: tuple) -> bool:
        """Whether a product of ``args`` (two activations, no parameter) is a square over this rank's tokens:
        attention scores written by hand (:mod:`autodist.cp.scores` computes them over the whole sequence)."""
        held = self.cut.held
        return (len(args) == 2 and held > 1 and all(isinstance(a, torch.Tensor) and a.ndim >= 2 for a in args)
                and args[0].shape[-2] == held and args[1].shape[-1] == held
                and not any(isinstance(a, nn.Parameter) for a in args))

    def square_over_tokens(self, args: tuple, made: Any) -> bool:
        """Whether ``made``, a product of ``args`` (no parameter among them), is a square over this rank's
        tokens: attention scores written by hand (by their shape alone, as a trace can tell)."""
        held = self.cut.held
        return isinstance(made, torch.Tensor) and made.ndim >= 2 and tuple(made.shape[-2:]) == (held, held) and \
            held > 1 and not any(isinstance(a, nn.Parameter) for a in args)

    def refuse_local_scores(self, func: Any, args: tuple, made: Any) -> None:
        """Raise where a product of activations (no parameter) is a square over this rank's tokens."""
        if self.square_over_tokens(args, made):
            refusals.refuse_local_scores(self.cut.parts, self.name, func, made)

    def derived(self, made: Any, source: Any, func: Any = None, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``made`` from the input ``source`` in its shape (``mask.bool()``, ``labels.to(device)``): an input too,
        and, made by ``func(*args, **kwargs)`` from integer inputs, with its whole (the same call on theirs)."""
        if isinstance(made, torch.Tensor) and made.shape == source.shape:
            self.inputs[id(made)] = self.inputs[id(source)]
            self.held_inputs.append(made)
            if func is not None and id(source) in self.wholes:  # made from the batch's inputs alone
                swapped = self._swapped(args, kwargs or {})
                try:  # a call with this rank's shape in its arguments (a view to its tokens) has no whole
                    whole = func(*swapped[0], **swapped[1]) if swapped is not None else None
                except (RuntimeError, ValueError, IndexError, TypeError):
                    whole = None
                if isinstance(whole, torch.Tensor) and whole.ndim == made.ndim and \
                        whole.shape[self.cut.dim] == self.cut.split.length:
                    self.wholes[id(made)] = whole
        return made

    def route(self, func: Any, args: tuple, kwargs: dict, compiled: bool = False) -> Any:
        """``func(*args, **kwargs)`` as the routing runs it (the module docstring), eagerly: every tensor its own;
        ``compiled``: between the graphs of a compiled forward (:mod:`autodist.cp.compiled`)."""
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        if self.wide and any(isinstance(a, torch.Tensor) and self.wide.get(id(a)) is a for a in args):
            return scores.on_wide(self, func, args, kwargs)
        if func in scores.PRODUCTS and self.local_scores(args):
            if compiled:  # the scores are followed by identity, which a graph does not keep
                refusals.refuse_compiled_scores(self.cut.parts, self.name, func)
            self.routed += 1
            return scores.wide_scores(self, func, args)
        if func is torch.arange:
            return self.positions(func(*args, **kwargs), args)
        tracked = bool(args) and id(args[0]) in self.inputs
        if func in (torch.diff, torch.Tensor.diff) and not tracked and args and self.are_positions(args[0]):
            return func(self.consecutive(args[0]), *args[1:], **kwargs)
        if func is torch.Tensor.__getitem__ and len(args) == 2 and (tracked or not args[0].is_floating_point()):
            index = self.local_index(args[0], args[1])
            if index is not None:  # read at this rank's own positions: what one process reads there
                made = func(args[0], index)
                return self.derived(made, args[0]) if tracked else made
        if tracked and func in refusals.ALONG and self.reaches_along(func, args, kwargs):
            made = self.from_whole(func, args, kwargs)
            if made is not NotImplemented:
                return made
            self.refuse_mixing(func, args, kwargs)
        if func in refusals.REDUCTIONS and not tracked and args and self.pools(args, kwargs):
            refusals.refuse_pooling(self.cut.parts, self.name, func, args[0])
        if func in refusals.MIXING and not tracked and args and self.mixes(func, args, kwargs):
            refusals.refuse_mixing_activation(self.cut.parts, self.name, func, args[0], self.cut.held)
        if func is F.multi_head_attention_forward:
            return multihead(self, *args, **kwargs)
        made = func(*args, **kwargs)
        if func in refusals.PRODUCTS:
            self.refuse_local_scores(func, args, made)
        return self.derived(made, args[0], func, args, kwargs) if tracked else made

    # -- what the mode reroutes ------------------------------------------------------------------------------------
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        parts, held = self.cut.parts, self.cut.held
        window = self.window
        is_causal, documents = self.masks.decide(attn_mask, is_causal, self.group, query.device, window)
        if dropout_p:
            raise NotImplementedError(f"cp={parts}: {self.name}'s attention has dropout_p={dropout_p} in training, "
                                      f"which would draw a different mask than one process: set attention dropout "
                                      f"to 0 under cp")
        if query.shape[-2] != held or key.shape[-2] != held:
            raise NotImplementedError(
                f"cp={parts}: {self.name}'s attention has {query.shape[-2]} queries and {key.shape[-2]} keys, but "
                f"this rank holds {held} tokens of the sequence: cp splits self-attention over the batch's own "
                f"tokens only (not a key/value cache or cross-attention)")
        self.routed += 1
        padding = self.masks.padding
        if (padding is not None or documents is not None) and enable_gqa and key.shape[-3] != query.shape[-3]:
            # Hugging Face repeats the key heads itself where it passes a mask, which a rank whose own tokens hold
            # no padding does not: every rank exchanges them repeated, so that the group's exchanges match (with
            # packed documents every rank passes a mask: the same)
            groups = query.shape[-3] // key.shape[-3]
            key, value, enable_gqa = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3), False
        if padding is None and attn_mask is not None:  # the masked kernel, as every rank of the group takes it
            padding = torch.ones(query.shape[0], self.cut.split.length, dtype=torch.bool, device=query.device)
        return context_attention(query, key, value, split=self.cut.split, group=self.group, causal=is_causal,
                                 key_padding=padding, documents=documents, window=window, scale=scale,
                                 enable_gqa=enable_gqa)

    def local_index(self, x: torch.Tensor, index: Any) -> Any:
        """``index`` into ``x`` (an input, or an integer tensor over this rank's tokens) with its index tensor along
        the sequence, which holds this rank's global positions (an ``arange`` replaced, broadcast: Hugging Face's
        ``padding_mask[batch, kv_idx]``, and under torch.compile its ``position_ids[batch, q_idx]``), given their
        places among this rank's tokens instead; None for any other index (a global position past this rank's
        count of tokens would not index them)."""
        items = list(index) if isinstance(index, tuple) else [index]
        if any(item is None or item is Ellipsis for item in items):
            return None
        dim = self.cut.dim % x.ndim
        if dim >= len(items) or not isinstance(items[dim], torch.Tensor) or x.shape[dim] != self.cut.held:
            return None
        item, held = items[dim], self.cut.held
        if item.is_floating_point() or item.numel() != held or held < 2:
            return None  # an index of this rank's positions has one for each of its tokens (broadcast alike)
        if not bool((item.flatten() == self.cut.split.positions(self.cut.rank).to(item.device)).all()):
            return None
        items[dim] = torch.arange(held, device=item.device).view(item.shape)
        return tuple(items) if isinstance(index, tuple) else items[0]

    def are_positions(self, x: Any) -> bool:
        """Whether ``x`` holds this rank's global positions (from ``start``), along its last dimension: what
        the replaced ``torch.arange`` gave, or ``position_ids`` made from it."""
        split, held = self.cut.split, self.cut.held
        if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.ndim == 0 or x.shape[-1] != held or held < 2:
            return False
        mine = split.positions(self.cut.rank).to(x.device)
        return bool((x - x[..., :1] == mine - mine[0]).all())

    def consecutive(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s first position, then the ones after it: what a ``torch.diff`` of this rank's positions reads."""
        return x[..., :1] + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)

    def positions(self, made: torch.Tensor, args: tuple) -> torch.Tensor:
        held, split = self.cut.held, self.cut.split
        if made.ndim != 1 or made.numel() != held or held in (0, split.length):
            return made
        if not bool((made[1:] - made[:-1] == 1).all()):
            return made  # not consecutive numbers: not positions
        start = made[0]
        if self.rows == held:
            raise NotImplementedError(
                f"cp={self.cut.parts}: torch.arange({', '.join(map(str, args))}) at {refusals.caller()} has the "
                f"length of this rank's {held} tokens, which is also the batch's rows: it cannot be told whether it "
                f"numbers the tokens (then it must be their global positions) or the rows; change the batch size or "
                f"the sequence length by one")
        if not self.logged and (not dist.is_initialized() or dist.get_rank() == 0):  # once, not per mp rank
            self.logged = True
            log.info("cp=%d: torch.arange(%s) at %s read as the positions of this rank's tokens in the sequence",
                     self.cut.parts, ", ".join(map(str, args)), refusals.caller())
        return (split.positions(self.cut.rank).to(made.device) + start).to(made.dtype)


_contexts: "weakref.WeakKeyDictionary[nn.Module, Context]" = weakref.WeakKeyDictionary()


def context_of(model: nn.Module) -> Context | None:
    """The routing :func:`attach` gave ``model`` (None: it is not context-parallel)."""
    return _contexts.get(model)


def attach(model: nn.Module, cut: SequenceCut, group: Any, scale: Callable[[], float],
           rows: tuple[int, int] = (0, 1)) -> Context:
    """Route ``model``'s attention and position calls over ``group`` for each forward (see the module docstring),
    and multiply the gradients of its outputs by ``scale()`` (the gradient sync's global units: a rank's keys and
    values take gradients from the other ranks' losses, which must be in the same unit as its own). ``rows``:
    (this rank's data-parallel index, their number), the rows a later loader is sharded by (``shard_data``).

    Example:
        >>> attach(model, SequenceCut(rank % 2, 2), cp_group, sync.global_units())
    """
    see_pads()
    context = Context(cut, group, type(model).__name__, scale)
    context.rows_of_data = rows
    _contexts[model] = context
    model.register_forward_pre_hook(context.enter, with_kwargs=True)
    model.register_forward_hook(context.leave, always_call=True, prepend=True)  # before the sync's: see leave
    for module in model.modules():  # a block the model checkpoints itself, run again in backward
        if module is not model:
            module.register_forward_pre_hook(context.recomputed_begins)
            module.register_forward_hook(context.recomputed_ends, always_call=True)
    for module, window in windows(model).items():  # each attention layer's sliding window, while it runs
        module.register_forward_pre_hook(partial(_set_window, context, window))
        module.register_forward_hook(partial(_set_window, context, None), always_call=True)
    return context


def _set_window(context: Context, window: int | None, *_: Any) -> None:
    context.window = window


def windows(model: nn.Module) -> dict[nn.Module, int]:
    """The attention layers of a Hugging Face model that attend within a sliding window, and its width: the layer's
    own ``sliding_window`` where it has one (Qwen2's, None on its full-attention layers), else its config's for a
    config without ``layer_types`` (Mistral's: every layer), or for the layers ``layer_types`` names
    ``"sliding_attention"`` (by ``layer_idx``). A layer is an attention module: its class name ends in
    "Attention"."""
    found = {}
    for module in model.modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        if "sliding_window" in vars(module) or hasattr(type(module), "sliding_window"):
            window = getattr(module, "sliding_window", None)
        else:
            config = getattr(module, "config", None)
            window = getattr(config, "sliding_window", None)
            layers, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
            if layers is not None and (index is None or layers[index] != "sliding_attention"):
                window = None
        if isinstance(window, int) and not isinstance(window, bool):
            found[module] = window
    return found


def _storage_of(x: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Where ``x``'s values are and their shape: the same for a tensor and a detached copy of it."""
    return x.data_ptr(), tuple(x.shape)


def _in_backward() -> bool:
    """Whether autograd's backward is running on this thread (a checkpointed block recomputed)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1
