"""``shard="optimizer"`` (ZeRO stage 1): each data-parallel rank keeps and updates only its slice of the
optimizer state, then the ranks all-gather the updated parameters.

The user's optimizer is built from ``model.parameters()`` as always. Around each of its steps the
process-wide optimizer-step hooks (:mod:`autodist.dp.step_hooks`) swap, for the duration of the step,
every parameter of the model in its param groups for this rank's *pieces* of it
(:mod:`autodist.sharded.layout`): 1-D views of the parameter's elements this rank owns, whose ``.grad``
is the same slice of the (already averaged) gradient. The optimizer updates those views in place, so it
touches 1/N of the elements and creates 1/N of the state. After the step the parameters are put back and
every rank's updated elements are all-gathered, so that each rank again holds the whole, identical model.
Between steps the pieces' state lives here, not in ``optimizer.state``.

This is the single-process update exactly, for optimizers that update each element on its own
(:data:`ELEMENTWISE`: SGD, Adam, AdamW, ...); one that looks across elements (Adafactor's factored
moments, LBFGS, Muon's orthogonalization) would compute something else on a slice, so it is refused.
Gradients are whole on every rank, so ``torch.nn.utils.clip_grad_norm_`` gives the global norm. Under
``shard="gradients"`` the pieces are the parts of the gradient buckets each rank keeps
(:mod:`autodist.sharded.scatter`) and each piece's gradient is its ``.grad``'s local slice. Under
``shard="parameters"`` the pieces are views of the blocks' shards themselves
(:mod:`autodist.sharded.parameters`), and nothing is all-gathered after the step.

``optimizer.state_dict()`` gives the dense state, as one process would have it (a collective: call it on
every rank, as ``autodist.save`` does), and ``optimizer.load_state_dict`` takes a dense state (from any
run, sharded or not, of any size) and keeps this rank's slice of it.

Example:
    >>> model, loader = autodist.parallelize(model, loader, shard="optimizer")
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # each rank keeps 1/N of its state
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp import step_hooks
from autodist.runtime import plain
from autodist.runtime.held import Held
from autodist.runtime.position import waiting
from autodist.runtime.shared_slots import shared_slots
from autodist.sharded.gather import Windows, streams, through_windows
from autodist.sharded.grads import ShardedGrad
from autodist.sharded.layout import Kind, Layout, Piece
from autodist.sharded.scatter import ring_bytes

ELEMENTWISE: set[type] = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
                          torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD}


def elementwise(cls: type) -> type:
    """Declare that optimizer class ``cls`` updates each element from that element's gradient and state alone
    (no norms, factors or matrices across elements), so ``shard="optimizer"`` may step it on slices.

    Example:
        >>> autodist.sharded.optimizer.elementwise(Lion)   # a decorator works too
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"elementwise() takes a torch.optim.Optimizer subclass, got {cls!r}")
    ELEMENTWISE.add(cls)
    return cls


_by_model: "weakref.WeakKeyDictionary[nn.Module, OptimizerSharding]" = weakref.WeakKeyDictionary()


class OptimizerSharding:
    """The pieces of ``model``'s trainable parameters this rank owns, their optimizer state between steps,
    and the hooks around the steps of every optimizer that holds them."""

    def __init__(self, model: nn.Module, group: Any, rank: int, ranks: int, sync: Any = None,
                 at_rest: Any = None, bucket_bytes: int = 25 << 20, own: frozenset[int] = frozenset()) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        # not those each rank holds its own of (expert parallelism's experts): stepped whole where they are
        self.params = [p for p in model.parameters() if p.requires_grad and id(p) not in own]
        # shard="parameters": the pieces are views of the blocks' shards, which nothing gathers after a step
        self.at_rest = at_rest
        for p in self.params if at_rest is None else ():
            if not p.is_contiguous():
                p.data = p.data.contiguous()  # the pieces are views of the flattened parameter
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # shard="gradients": the pieces are the parts of the buckets each rank keeps of the gradients' sum
        self.sync, self.buckets = sync, None if sync is None else sync.buckets
        self.layout = Layout.of(self.params, ranks) if sync is None else \
            Layout.of_groups(self.params, [[self.index[id(p)] for p in b.params] for b in sync.buckets], ranks)
        self.pieces: dict[int, list[Piece]] = {}
        for piece in self.layout.mine(rank):
            self.pieces.setdefault(piece.index, []).append(piece)
        self.views: dict[Piece, torch.Tensor] = {}  # the tensor the optimizer steps for each piece (its state key)
        self.store: dict[Piece, dict[str, Any]] = {}  # each piece's optimizer state between steps
        self.holds: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self.swapped: dict[int, list[torch.Tensor]] = {}  # id(param group) -> its own params, during a step
        # On one machine the updated pieces meet in shared memory, through two windows (autodist.sharded.gather)
        self.streams = streams(self.layout.kinds, ranks)
        self.mapping = None  # the windows' own file of shared memory (shard="optimizer" on one machine)
        self.windows = None if at_rest is not None else self._windows(bucket_bytes)
        step_hooks.listen(self)

    def _windows(self, bucket_bytes: int) -> list[Windows] | None:
        """Two windows of shared memory per stream (shard="gradients": the gradient buckets' ring, free between
        syncs), each as large as a ring buffer; None where the ranks cannot share memory. A collective."""
        if self.sync is not None:
            ring = getattr(self.sync.exchange, "windows", None)  # the ring in shared memory, or the backend's
            # every stream through it, one after the other (it is of the dtype gradients are summed in, which
            # holds each stream's numbers exactly: float32 for float16, bfloat16 and float32 parameters)
            return None if ring is None else [ring()] * len(self.streams)
        total = sum(p.numel() * p.element_size() for p in self.params)
        sizes = [min(s.length, max(1, ring_bytes(total, self.ranks, bucket_bytes) // s.dtype.itemsize))
                 for s in self.streams]
        shared = shared_slots([torch.empty(n, dtype=s.dtype, device=s.device) for s, n in zip(self.streams, sizes)
                               for _ in range(2)], self.group, "the sharded parameters")
        if shared is None:
            return None
        self.mapping = shared.mapping
        return [Windows(shared.slots[2 * i:2 * i + 2], shared.fence) for i in range(len(self.streams))]

    # -- which optimizers --------------------------------------------------------------------------
    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self.holds.get(optimizer)
        if holds is None:
            holds = any(id(p) in self.index for g in optimizer.param_groups for p in g["params"])
            if holds:
                self._adopt(optimizer)
            self.holds[optimizer] = holds
        return holds

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        if not any(cls is known for known in ELEMENTWISE):
            raise TypeError(
                f"shard='optimizer' steps each rank's slice of every parameter on its own, which is the "
                f"single-process update only for an optimizer that treats every element alone (SGD, Adam, AdamW, "
                f"...); {cls.__module__}.{cls.__qualname__} is not known to (Adafactor, LBFGS or Muon look across "
                f"elements). Use shard=None, or, if its update is elementwise, declare it first with "
                f"autodist.sharded.optimizer.elementwise({cls.__qualname__})")
        optimizer.register_state_dict_post_hook(self._dense_state_dict)
        optimizer.register_load_state_dict_post_hook(self._loaded)

    # -- around a step -----------------------------------------------------------------------------
    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._holds(optimizer):
            return
        if self.at_rest is not None and self.at_rest.pins:
            raise RuntimeError("optimizer.step() inside autodist.full_parameters(model): the step updates each "
                               "rank's part of the parameters (shard='parameters'), which the whole ones gathered "
                               "for the block would then overwrite at its end; step outside the block")
        if self.sync is not None and self.sync.buckets is not self.buckets:
            level = "gradients" if self.at_rest is None else "parameters"
            raise RuntimeError(
                f"the model's trainable parameters changed after parallelize(..., shard={level!r}) (requires_grad, "
                f"dtype or device), so its gradient buckets and the ranks' parts of them changed under the optimizer "
                f"state; freeze or unfreeze before parallelize (docs/sharded.md, 'Frozen parameters'), or use "
                f"shard='optimizer'")
        self._restore(optimizer)  # a step that raised never reached after_step
        self._cut(optimizer)
        for group in optimizer.param_groups:
            own, stepped = group["params"], []
            for p in own:
                i = self.index.get(id(p))
                if i is None:
                    stepped.append(p)  # not the model's: stepped whole, as always
                    continue
                if p.grad is None:
                    continue  # the optimizer would skip it: nothing of it changes on any rank
                sharded = p.grad if isinstance(p.grad, ShardedGrad) else None  # then: one piece, its local values
                grad = p.grad.detach().reshape(-1) if sharded is None else None
                for piece in self.pieces.get(i, ()):
                    view = self.views.get(piece)
                    if view is None:
                        view = self.views[piece] = self._param_slice(piece)
                    else:
                        view.data = self._param_slice(piece)  # the parameter's storage may have been replaced
                    view.grad = grad[piece.start:piece.stop] if sharded is None else sharded.local
                    state = self.store.pop(piece, None)
                    if state is not None:
                        optimizer.state[view] = state
                    stepped.append(view)
            self.swapped[id(group)] = own
            group["params"] = stepped

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._holds(optimizer) or not self.swapped:
            return
        self._restore(optimizer)
        if self.at_rest is not None:
            self.at_rest.stepped()
            return
        with torch.no_grad(), waiting("the all-gather of the sharded parameters after optimizer.step()"):
            self._gather_parameters()

    def _restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the param groups their own parameters back; the pieces' state goes back to the store."""
        pieces = {id(v): piece for piece, v in self.views.items()}
        for group in optimizer.param_groups:
            own = self.swapped.pop(id(group), None)
            if own is None:
                continue
            for t in group["params"]:
                piece = pieces.get(id(t))
                if piece is not None:
                    t.grad = None
                    state = optimizer.state.pop(t, None)
                    if state:
                        self.store[piece] = state
            group["params"] = own

    def _param_slice(self, piece: Piece) -> torch.Tensor:
        """The elements of ``piece``: in the parameter, or (``shard="parameters"``) in its block's shard."""
        if self.at_rest is not None:
            p = self.params[piece.index]
            return piece.in_chunk(self.at_rest.block_of[id(p)].shard_of(p))
        return self.params[piece.index].detach().view(-1)[piece.start:piece.stop]

    def _gather_parameters(self) -> None:
        """Every rank's updated elements into every rank's parameters: through two windows of shared memory on
        one machine (:mod:`autodist.sharded.gather`), else the backend's all-gather, a kind at a time."""
        if self.windows is None:
            for kind in self.layout.kinds:
                theirs = self._through_backend(kind, kind.dtype, self._param_slice)
                self._unpack(kind, theirs, lambda piece, values: self._param_slice(piece).copy_(values),
                             skip=self.rank)
            return
        k = 0
        for stream, windows in zip(self.streams, self.windows):
            k = through_windows(stream, self.rank, windows, self._param_slice, k)
        if k:
            self.windows[0].fence.wait()  # every rank read every window: they may be written again

    def _pack(self, kind: Kind, chunk: torch.Tensor, value_of: Callable[[Piece], torch.Tensor | None]) -> None:
        """This rank's pieces of ``kind`` into its ``chunk`` (a piece whose value is None is left as it is)."""
        for piece in kind.pieces[self.rank]:
            value = value_of(piece)
            if value is not None:
                piece.in_chunk(chunk).copy_(value)

    def _through_backend(self, kind: Kind, dtype: torch.dtype,
                         value_of: Callable[[Piece], torch.Tensor | None]) -> list[torch.Tensor]:
        """Every rank's chunk of ``kind`` (this rank's packed from ``value_of``, zeros elsewhere), all-gathered."""
        mine = torch.zeros(kind.chunk, dtype=dtype, device=kind.device)
        self._pack(kind, mine, value_of)
        every = torch.empty(self.ranks * kind.chunk, dtype=dtype, device=kind.device)
        chunks = list(every.view(self.ranks, kind.chunk))
        dist.all_gather(chunks, mine, group=self.group)
        return chunks

    @staticmethod
    def _unpack(kind: Kind, chunks: list[torch.Tensor], put: Callable[[Piece, torch.Tensor], Any],
                skip: int | None = None) -> None:
        """``put(piece, its values)`` for every rank's pieces of ``kind`` (but rank ``skip``'s) from ``chunks``."""
        for r, pieces in enumerate(kind.pieces):
            if r != skip:
                for piece in pieces:
                    put(piece, piece.in_chunk(chunks[r]))

    # -- state: dense outside, sliced inside -------------------------------------------------------
    def _cut(self, optimizer: torch.optim.Optimizer) -> None:
        """Dense state the optimizer holds for the model's parameters (loaded) becomes this rank's slices."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self.index.get(id(p))
                if i is None or p not in optimizer.state:
                    continue
                dense = optimizer.state.pop(p)
                for piece in self.pieces.get(i, ()):
                    self.store[piece] = {k: _slice(v, p, piece) for k, v in dense.items()}

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """``load_state_dict`` replaced the whole state: the slices held before go, the new dense state is cut."""
        self.store.clear()
        self._cut(optimizer)

    def _dense_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state every rank holds a slice of, whole, at each parameter's index in ``state_dict``."""
        positions: dict[int, int] = {}
        start = 0
        for group in optimizer.param_groups:  # torch's own numbering (Optimizer.state_dict)
            for i, p in enumerate(group["params"], start):
                positions.setdefault(id(p), i)
            start += len(group["params"])
        with waiting("optimizer.state_dict() of an optimizer over a sharded model (a collective: call it on every "
                     "rank, as autodist.save does)"):
            dense = self._dense()
        for i, state in dense.items():
            if id(self.params[i]) in positions:
                state_dict["state"][positions[id(self.params[i])]] = state
        return state_dict

    def _dense(self) -> dict[int, dict[str, Any]]:
        """{parameter index: its whole state} for every parameter that has state on its owners."""
        elementwise: dict[str, str] = {}  # key -> dtype, of the per-element entries this rank holds
        scalars: dict[int, dict[str, Any]] = {}  # parameter -> its other entries, from the owner of its first element
        for piece, state in self.store.items():
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    elementwise[k] = str(v.dtype).removeprefix("torch.")
                elif piece.start == 0:
                    scalars.setdefault(piece.index, {})[k] = _plain(v)
            if piece.start == 0:
                scalars.setdefault(piece.index, {})
        keys: dict[str, str] = {}
        merged: dict[int, dict[str, Any]] = {}
        for their_keys, their_scalars in plain.all_gather((elementwise, scalars), self.group):
            keys.update(their_keys)
            merged.update({int(i): s for i, s in their_scalars.items()})
        dense = {i: {k: _unplain(v) for k, v in s.items()} for i, s in merged.items()}
        for key, dtype in sorted(keys.items()):
            for kind in self.layout.kinds:
                if not any(i in dense for i in kind.indices):
                    continue
                whole = self._gather_key(kind, key, getattr(torch, dtype))
                for i, flat in whole.items():
                    if i in dense:
                        dense[i][key] = flat.view(self.params[i].shape)
        return dense

    def _gather_key(self, kind: Kind, key: str, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        theirs = self._through_backend(kind, dtype, lambda piece: self.store.get(piece, {}).get(key))
        whole = {i: torch.zeros(self.params[i].numel(), dtype=dtype, device=kind.device) for i in kind.indices}
        self._unpack(kind, theirs, lambda piece, values: whole[piece.index][piece.start:piece.stop].copy_(values))
        return whole

    def held_bytes(self) -> int:
        """Bytes of optimizer state this rank holds between steps (its slices)."""
        return sum(v.numel() * v.element_size() for s in self.store.values() for v in s.values() if torch.is_tensor(v))

    def held(self) -> Held:
        """The slices of the optimizer state, and the windows' file, for ``autodist.memory``."""
        held = Held()
        held.add("optimizer state", *(v for s in self.store.values() for v in s.values() if torch.is_tensor(v)))
        held.share(self.mapping, self.ranks)
        return held


def _slice(value: Any, param: torch.Tensor, piece: Piece) -> Any:
    """A dense state entry cut to ``piece``: per-element tensors sliced (a copy), the rest as they are."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
        return value.detach().reshape(-1)[piece.start:piece.stop].clone()
    return value.clone() if torch.is_tensor(value) else value


def _plain(value: Any) -> Any:
    """A scalar state entry as plain data (a 0-dim tensor keeps its dtype)."""
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def setup(model: nn.Module, group: Any, rank: int, ranks: int, sync: Any = None,
          at_rest: Any = None, bucket_bytes: int = 25 << 20, own: frozenset[int] = frozenset()) -> OptimizerSharding:
    """Shard the optimizer state of ``model`` over the ``ranks`` data-parallel ranks of ``group`` (this one is
    ``rank``); the model keeps the sharding alive. ``sync``: the gradient sync whose buckets' parts the ranks
    keep (``shard="gradients"``), whose cut the optimizer's pieces then follow; ``at_rest``: the
    :class:`~autodist.sharded.parameters.ParameterSharding` whose shards the pieces are
    (``shard="parameters"``); ``bucket_bytes``: the gradient buckets' size, which bounds the shared windows the
    updated parameters are gathered through; ``own``: ids of parameters each rank holds its own of (ep's experts),
    left whole to each rank's optimizer."""
    sharding = _by_model[model] = OptimizerSharding(model, group, rank, ranks, sync, at_rest, bucket_bytes, own)
    return sharding


def sharding_of(model: nn.Module) -> OptimizerSharding | None:
    """The sharding ``parallelize(..., shard="optimizer")`` set up for ``model``, if any."""
    return _by_model.get(model)
