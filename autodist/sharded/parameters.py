"""``shard="parameters"`` (fully sharded, ZeRO stage 3): parameters sharded at rest, gathered block by block.

The trainable parameters of each block (:mod:`autodist.sharded.blocks`; the rest form the *root*) are one
flat vector cut in N even parts (:class:`~autodist.sharded.layout.Layout`, the cut the gradient buckets and
the optimizer's pieces use): rank r keeps part r, its ``shard``. A parameter at rest holds a placeholder
of its shape (one number of memory) and refuses to be read (:mod:`autodist.sharded.at_rest`), so
``model.parameters()``, shapes and the optimizer's param groups are as always and no value read is
silently wrong; :func:`full_parameters` gathers every block to read or write the whole weights. Then:

* forward: before a block runs, its parts are all-gathered into a buffer of the whole block and its
  parameters become views of it; after it runs they are placeholders again. The block after it (in the
  last forward's order) is gathered meanwhile (asynchronously, on a process group of its own). The root is
  gathered when the model (or a module holding root parameters) is called, and kept until the end of
  backward;
* backward: while a block runs forward, autograd's saved tensors that are its parameters (or views of
  them) are saved as *where they were* in the block (saved-tensor hooks), not as tensors. When the
  gradient of one of its outputs arrives (or backward first needs one of those tensors), the block is
  gathered again (and the block before it meanwhile), and it is freed as soon as its gradients are packed
  (each block is one bucket of the reduce-scatter: :mod:`autodist.sharded.scatter`). Activation
  checkpointing works either way: inside the block's hooks (Hugging Face's), its recomputation finds the
  block gathered; around them (``checkpoint(block, x)``), the recomputation gathers it;
* step: the optimizer steps each rank's part (:mod:`autodist.sharded.optimizer`): the shard itself, in
  place. Nothing is all-gathered after the step; the next forward gathers what it needs.

Every rank must gather the same blocks in the same order (the same forward): at the end of each backward,
and after each forward without gradients, one all-reduce checks it, and a difference (layer drop, early
exit, a branch on the data) raises before anything is stepped.

``model.state_dict()`` gathers the blocks one at a time into dense tensors (a collective: call it on every
rank); ``model.load_state_dict`` takes a dense one and keeps this rank's part. These reads gather on a process
group of their own, so a rank that calls one alone waits there, named, and never meets another rank's
forward gathers.

Example:
    >>> model, loader = autodist.parallelize(model, loader, shard="parameters")
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # each rank holds 1/N of everything
"""
from __future__ import annotations

import collections
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autodist.runtime.compiled import unwrapped
from autodist.runtime.held import Held
from autodist.runtime.position import waiting
from autodist.runtime.tree import tensor_leaves
from autodist.runtime.world import log
from autodist.sharded import blocks as blocks_mod
from autodist.sharded.block import Block
from autodist.sharded.scatter import Scatter, ScatteredBucket


@dataclass(frozen=True)
class Saved:
    """Where a tensor autograd saved sat in its block's gathered buffers: which part, where in it."""

    block: Block
    part: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # not a plain tensor: never a view of a block
        return None


def _refuse_a_second_call(block: Block) -> None:
    """A block run twice in one forward (shared layers, as ALBERT's) under mixed_precision: each call gathers it
    anew in the compute dtype, which gives its parameters a second gradient accumulator (torch makes one per
    dtype change), and the calls' gradients would add in that dtype, not in float32 as without shard=."""
    raise RuntimeError(f"block {block.name!r} ran twice in one forward under mixed_precision with "
                       f"shard='parameters' (a layer shared by several places of the model): not supported. Use "
                       f"shard='gradients' or 'optimizer', or blocks=[...] naming a module that holds the shared "
                       f"layer and runs once a forward")


class ParameterSharding:
    """The blocks of one model, the hooks that gather and free them, and its dense state dict."""

    def __init__(self, model: nn.Module, chosen: blocks_mod.Choice, group: Any, rank: int, ranks: int,
                 reading_group: Any = None, own: frozenset[int] = frozenset()) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        # the gathers that read the whole model (state_dict, full_parameters, copies) go on a group of their own
        self.reading_group = group if reading_group is None else reading_group
        self.pins = 0  # autodist.full_parameters blocks open
        everything = [p for p in model.parameters() if id(p) not in own]  # not each rank's own (ep's experts)
        trainable = [p for p in everything if p.requires_grad]
        for p in trainable:
            if p.device != trainable[0].device:
                raise NotImplementedError("shard='parameters' needs every trainable parameter on one device: move "
                                          "the model with model.to(device) first, or use shard='optimizer'")
        found = blocks_mod.find(model, chosen)
        owners: dict[int, list[int]] = {}
        for b, (_, module) in enumerate(found):
            for p in module.parameters():
                owners.setdefault(id(p), []).append(b)
        members: list[list[nn.Parameter]] = [[] for _ in found]
        root: list[nn.Parameter] = []
        for p in everything:  # frozen ones too: sharded alike, never reduced; one two blocks share (tied): the root
            held = owners.get(id(p), [])
            (members[held[0]] if len(held) == 1 else root).append(p)
        named = [(name, module, ps) for (name, module), ps in zip(found, members) if ps]
        if root:
            named.append(("(root)", model, root))
        if not found and rank == 0:
            log.warning("%s. Until then the whole model is gathered for every forward and backward (that much "
                        "memory more while a step runs) and held sharded between steps",
                        blocks_mod.none_found(model, "shard='parameters'"))
        holders = collections.Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
        shared = frozenset(i for i, n in holders.items() if n > 1)  # tied weights (an embedding and its output)
        self.blocks = [Block(i, name, ps, rank, ranks, shared) for i, (name, _, ps) in enumerate(named)]
        self.root = self.blocks[-1] if root else None
        self.block_of = {id(p): blk for blk in self.blocks for p in blk.params}
        self.by_module = {id(m): blk for (_, m, _), blk in zip(named, self.blocks) if blk is not self.root}
        # the blocks of the forward running now, in order; the last forward's order, for gathering ahead
        self.seen: list[Block] = []
        self.next_of: dict[Block, Block] = {}
        self.before: dict[Block, Block] = {}
        self.trace = 0  # which blocks were gathered, in which order, since the last check
        self.hooking: list[tuple[Any, Block]] = []  # the blocks running now, with their saved-tensor hooks
        self.handles = self._hook(model, [module for _, module, ps in named if ps is not root])

    def compute_in(self, dtype: torch.dtype) -> None:
        """``mixed_precision``: gather every block in ``dtype`` for its forward and backward (half the bytes of
        float32); its parameters hold that dtype while gathered, their float32 chunks stay the master."""
        for block in self.blocks:
            block.compute = dtype

    # -- forward -----------------------------------------------------------------------------------
    def _hook(self, model: nn.Module, modules: list[nn.Module]) -> list[Any]:
        """Hooks on ``model`` and on each block's module (``modules``). The gathers and frees run outside
        torch.compile's graphs, as FSDP2's hooks do: a compiled model's graph ends at each block, whose own
        forward compiles whole, and saves its parameters for backward as they are (gathered again when backward
        reaches the block, as the saved-tensor hooks do uncompiled)."""
        eager = torch.compiler.disable
        handles = [model.register_forward_pre_hook(eager(self._model_begins)),
                   model.register_forward_hook(eager(self._model_ends), always_call=True)]
        for module in modules:
            handles += [module.register_forward_pre_hook(eager(self._block_begins)),
                        module.register_forward_hook(eager(self._block_ends), always_call=True)]
        if self.root is not None:
            root = {id(p) for p in self.root.all_params()}
            for module in model.modules():
                if module is not model and any(id(p) in root for p in module._parameters.values()):
                    handles.append(module.register_forward_pre_hook(self._root_needed))
        handles += [model.register_state_dict_post_hook(partial(self._dense_state)),  # torch marks the hook
                    model.register_load_state_dict_pre_hook(self._before_load),
                    model.register_load_state_dict_post_hook(self._after_load)]
        return handles

    def _gather(self, block: Block, wait: bool = True) -> None:
        if block.start(self.group):
            self.trace = (self.trace * 1_000_003 + block.number + 1) % (1 << 50)
        if wait:
            block.ready()

    def _root_needed(self, *_: Any) -> None:
        """A module holding root parameters is called: the root gathered, if it is not (traced by torch.compile
        as the test alone: inside the model's forward the root is gathered, so nothing breaks the graph)."""
        if self.root is not None and not self.root.live:
            self._gather_root()

    @torch.compiler.disable
    def _gather_root(self) -> None:
        assert self.root is not None
        self._gather(self.root)

    def _model_begins(self, module: nn.Module, args: Any) -> None:
        self.seen = []
        if self.root is not None:
            self._gather(self.root)

    def _model_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.seen:
            order, self.seen = self.seen, []
            self.next_of = dict(zip(order, order[1:]))
            self.before = dict(zip(order[1:], order))
        if not torch.is_grad_enabled():  # no backward follows: free the root, and check the gathers
            if self.root is not None:
                self.root.release()
            self.check()

    def _block_begins(self, module: nn.Module, args: Any) -> None:
        block = self.by_module[id(module)]
        if block not in self.seen:
            self.seen.append(block)
        elif block.compute is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            _refuse_a_second_call(block)  # (not a checkpointed block's recompute, which runs in backward)
        self._gather(block)
        following = self.next_of.get(block)
        if following is not None:
            self._gather(following, wait=False)
        # Under saved-tensor hooks of the user's (activation checkpointing, offloading) what autograd saves is
        # theirs to keep: a checkpointed block runs its forward again in backward, which gathers it again.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) \
            if torch.is_grad_enabled() and not outer else None
        if hooks is not None:
            hooks.__enter__()
        self.hooking.append((hooks, block))

    def _block_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        raised = sys.exc_info()[1] is not None  # (always_call) the block's forward raised: a gather failed, say
        hooks = self.hooking.pop()[0] if self.hooking else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        block = self.by_module[id(module)]
        if torch.is_grad_enabled():  # backward reaches the block's outputs first: gather it then
            for _, t in tensor_leaves(output):
                if t.requires_grad:
                    t.register_hook(partial(self._backward_begins, block))
            if not block.params:  # no bucket frees a frozen block: its backward is done when its inputs' is
                for _, t in tensor_leaves(args):
                    if t.requires_grad:
                        t.register_hook(partial(self._frozen_done, block))
        try:
            block.release()
        except Exception:  # its gather failed too (a rank lost): the forward's own error is the one to see
            if not raised:
                raise

    # -- backward ----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        """A tensor autograd saves while a block runs: one of a block's parameters (or a view of one) is kept
        as where it sits in the block, so the block can be freed until backward needs it."""
        if torch.compiler.is_compiling():  # traced into a compiled block, which saves what it saves (see _hook)
            return t
        block = self.hooking[-1][1] if self.hooking else None
        where = _storage(t) if block is not None else None
        for i, part in enumerate(block.parts if where is not None else ()):
            if part.full is not None and where == part.full.untyped_storage().data_ptr():
                return Saved(block, i, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, Saved):
            return saved
        self._for_backward(saved.block)
        full = saved.block.parts[saved.part].full
        assert full is not None
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _backward_begins(self, block: Block, grad: torch.Tensor) -> None:
        """The gradient of one of ``block``'s outputs: its backward (or its recomputation, where its forward is
        checkpointed, as Hugging Face's gradient checkpointing does inside the module's hooks) comes next."""
        self._for_backward(block)

    def _frozen_done(self, block: Block, grad: torch.Tensor) -> None:
        """The gradient of an input of a block without trainable parameters: its backward is done."""
        block.release()

    def _for_backward(self, block: Block) -> None:
        if block.full is None or block.work is not None or not block.live:
            self._gather(block)
            earlier = self.before.get(block)
            if earlier is not None:
                self._gather(earlier, wait=False)

    def backward_ended(self) -> None:
        """Every block back to its shard (autograd's gradients are summed), then the gathers checked."""
        self.stepped()
        self.check()

    def check(self) -> None:
        """One all-reduce: every rank gathered the same blocks in the same order since the last check."""
        mine = torch.tensor([self.trace, -self.trace], dtype=torch.float64, device=self.blocks[0].parts[0].shard.device)
        with waiting("the check that every rank gathered the same blocks (shard='parameters')"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        if mine.tolist() != [self.trace, -self.trace]:
            raise RuntimeError(
                "the data-parallel ranks gathered different blocks of the model (or in another order) in this "
                "forward and backward: shard='parameters' needs every rank to run the same layers (layer drop, "
                "early exit or a branch on the data differ between ranks). Use shard='gradients', which gathers "
                "nothing during forward")
        self.trace = 0

    # -- around the optimizer's step ---------------------------------------------------------------
    def stepped(self) -> None:
        """Every block back to its shard: after a step the shards changed, and what is still gathered (a forward
        with gradients and no backward) is stale."""
        for block in self.blocks:
            block.release()

    # -- state -------------------------------------------------------------------------------------
    def _read(self, block: Block, what: str) -> None:
        """Gather ``block`` to read it whole, on the reading group (nothing in flight on the other is met);
        ``what``: the collective read, as the watchdog names it."""
        block.start(self.reading_group, reading=True)
        block.ready(f"{what}, a collective: call it on every rank (shard='parameters' gathers every block)")

    def _dense_state(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Each block gathered in turn and its parameters' entries made dense copies (a collective)."""
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(prefix + name)
        for block in self.blocks:
            params = block.all_params()
            keys = [[k for k in names.get(id(p), ()) if k in state_dict] for p in params]
            was = block.full is not None
            self._read(block, "model.state_dict()")
            for p, ks in zip(params, keys):
                for k in ks:
                    state_dict[k] = p.detach().clone() if not isinstance(state_dict[k], nn.Parameter) else \
                        nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            if not was:
                block.release()

    def _before_load(self, module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        """Every block whole, so that loading writes into real parameters."""
        for block in self.blocks:
            self._read(block, "model.load_state_dict()")

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        for block in self.blocks:
            block.keep(self.rank)
            block.release()

    def pin(self, what: str) -> None:
        """Every block gathered and held whole until :meth:`unpin` (a collective: every rank calls it)."""
        if self.pins == 0:
            for block in self.blocks:
                self._read(block, what)
            for block in self.blocks:
                block.pinned = True
        self.pins += 1

    def unpin(self) -> None:
        """The end of a :meth:`pin`: at the last one each rank keeps its chunk of the (maybe changed) whole
        parameters, and every block is freed."""
        self.pins -= 1
        if self.pins == 0:
            for block in self.blocks:
                block.pinned = False
                block.keep(self.rank)
                block.release()

    def held(self) -> Held:
        """This rank's shards and the blocks gathered now, for ``autodist.memory``."""
        held = Held()
        for b in self.blocks:
            held.add("parameters", *b.held_tensors())
        return held

    def held_bytes(self) -> int:
        """Bytes of parameters this rank holds now (its shards and what is gathered)."""
        return sum(t.numel() * t.element_size() for b in self.blocks for part in b.parts
                   for t in (part.shard, part.full) if t is not None)


class BlockScatter(Scatter):
    """The gradient buckets of ``shard="parameters"``: one per block, sent last block first (the root last),
    each freeing its block's parameters once packed."""

    level = "parameters"

    at_rest = True  # the parameters are placeholders between uses: the gradient sync reads none outside a block

    def __init__(self, sharding: ParameterSharding, group: Any, rank: int, ranks: int) -> None:
        super().__init__(group, rank, ranks)
        self.sharding = sharding
        self.packed: dict[Block, set[int]] = {}  # each block's buckets packed in this backward

    def assign(self, params: list[nn.Parameter], caps: tuple[int, int]) -> list[list[int]]:
        index = {id(p): i for i, p in enumerate(params)}
        blocks = self.sharding.block_of
        if set(index) != set(blocks) or any((p.dtype, p.device) != (blocks[id(p)].shard_of(p).dtype,
                                                                    blocks[id(p)].shard_of(p).device) for p in params):
            raise RuntimeError("the model's trainable parameters changed after parallelize(..., shard='parameters') "
                               "(requires_grad, dtype or device): its blocks were cut into trainable and frozen "
                               "parts then. Freeze or unfreeze before parallelize (docs/sharded.md, 'Frozen "
                               "parameters'), or use shard=None, which follows such changes")
        self._set_cap(params, caps[1])  # a block larger than the ring's buffers is packed window by window
        blocks = [b for b in self.sharding.blocks if b.params]  # a frozen block has no gradients
        root = self.sharding.root
        order = [b for b in reversed(blocks) if b is not root] + [b for b in blocks if b is root]
        return [[index[id(p)] for p in part.params] for block in order for part in block.trained]

    def bucket(self, params: list[nn.Parameter], extra: int) -> ScatteredBucket:
        bucket = super().bucket(params, extra)
        bucket.after_pack = partial(self._packed, self.sharding.block_of[id(params[0])], bucket)
        return bucket

    def _packed(self, block: Block, bucket: ScatteredBucket) -> None:
        """Once every part of ``block`` is packed (one bucket each), nothing of this backward needs its
        parameters any more."""
        done = self.packed.setdefault(block, set())
        done.add(id(bucket))
        if len(done) == len(block.trained):
            done.clear()
            block.release()

    def backward_ended(self) -> None:
        self.packed.clear()  # (a backward that failed midway left some)
        self.sharding.backward_ended()


_by_model: "weakref.WeakKeyDictionary[nn.Module, ParameterSharding]" = weakref.WeakKeyDictionary()


def setup(model: nn.Module, chosen: blocks_mod.Choice, group: Any, rank: int, ranks: int,
          reading_group: Any = None, own: frozenset[int] = frozenset()) -> ParameterSharding:
    """Shard ``model``'s trainable parameters over the ``ranks`` ranks of ``group`` (its own process group for
    the gathers, so that they never interleave with the gradient sync's collectives), block by block;
    ``reading_group``: another such group, for the gathers that read the whole model; ``own``: the ids of the
    parameters each rank holds its own of (expert parallelism's experts), left as they are."""
    sharding = _by_model[model] = ParameterSharding(model, chosen, group, rank, ranks, reading_group, own)
    return sharding


def sharding_of(model: nn.Module) -> ParameterSharding | None:
    """The parameter sharding ``parallelize(..., shard="parameters")`` set up for ``model``, if any."""
    return _by_model.get(model)


def full_parameters(model: nn.Module) -> ContextManager[nn.Module]:
    """The model's whole parameters, readable and writable, inside the block; each rank's part after it.

    Under ``shard="parameters"`` each rank holds 1/N of every parameter between uses, and reading one
    raises. Inside this block every block of the model is gathered (a collective: every data-parallel rank
    enters it; one that enters alone waits there, named by the watchdog, never meeting another rank's
    forward), so the parameters hold their true values: log their norms, update an EMA, copy them. What is
    written into them is kept (each rank keeps its part) when the block ends, and the memory is freed. A
    forward inside it uses the gathered blocks; ``optimizer.step()`` inside it raises. At every other level
    (and in one process) the parameters are whole already and this does nothing. Nested blocks gather once.

    Example:
        >>> with autodist.full_parameters(model):
        ...     ema.update_parameters(model)
        ...     norm = sum(p.norm() ** 2 for p in model.parameters()) ** 0.5
    """
    return gathered(model, "autodist.full_parameters(model)")


@contextmanager
def gathered(model: nn.Module, what: str) -> Iterator[nn.Module]:
    """Every block of ``model`` gathered and held whole for ``what`` (the watchdog's words for it), then each
    rank's part kept and the blocks freed: :func:`full_parameters`, and the copies of the model. Nothing
    without ``shard="parameters"``."""
    sharding = sharding_of(unwrapped(model))
    if sharding is None:
        yield model
        return
    sharding.pin(what)
    try:
        yield model
    finally:
        sharding.unpin()
