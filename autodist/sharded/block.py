"""One block of ``shard="parameters"``: its parameters sharded at rest, gathered whole while in use.

A block's parameters form *parts*, each one flat vector of one dtype and device cut in N even chunks
(:class:`~autodist.sharded.layout.Layout`): its trainable parameters (the cut the gradient bucket and the
optimizer's pieces use too), and its frozen ones (a fine-tuned base: gathered for forward and backward like
the others, reduced and stepped never). Rank r keeps chunk r of each part; gathering all-gathers every part
into a buffer of the whole and makes the parameters views of it; releasing drops those buffers and gives
every parameter a placeholder of its shape (one number of memory), which refuses to be read
(:mod:`autodist.sharded.at_rest`).

Example:
    >>> block = Block(0, "layers.0", list(layer.parameters()), rank, ranks)
    >>> block.start(group); block.ready()   # whole: the parameters are views of the gathered buffers
    >>> block.release()                     # placeholders again, this rank's chunks only
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autodist.runtime.comm import all_gather_single
from autodist.runtime.position import waiting
from autodist.sharded.at_rest import rest, wake
from autodist.sharded.layout import Layout


class Part:
    """Parameters of one dtype and device as one flat vector: this rank's chunk at rest, the whole while gathered."""

    def __init__(self, params: list[nn.Parameter], rank: int, ranks: int, keeps_dtype: bool = False) -> None:
        self.params, self.ranks = params, ranks
        self.keeps_dtype = keeps_dtype  # gathered in the master's dtype whatever the block's compute dtype
        self.chunk = Layout.of_groups(params, [list(range(len(params)))], ranks).kinds[0].chunk
        like = params[0]
        self.spans, offset = [], 0
        flat = torch.zeros(self.chunk * ranks, dtype=like.dtype, device=like.device)
        for p in params:
            self.spans.append((offset, p.numel()))
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        self.shard = flat[rank * self.chunk:(rank + 1) * self.chunk].clone()
        self.full: torch.Tensor | None = None  # the whole part, while gathered
        self.work: Any = None  # its all-gather, while in flight

    def start(self, group: Any, dtype: torch.dtype | None = None) -> None:
        """Begin gathering the whole part; ``dtype``: in that dtype (``mixed_precision``: half the bytes of the
        float32 master, and the parameters hold it while gathered)."""
        dtype = dtype or self.shard.dtype
        self.full = torch.empty(self.chunk * self.ranks, dtype=dtype, device=self.shard.device)
        source = self.shard if dtype == self.shard.dtype else self.shard.to(dtype)
        self.work = all_gather_single(self.full, source, group=group, async_op=True)

    def views(self) -> None:
        """The parameters become views of the whole part."""
        assert self.full is not None
        for p, (offset, n) in zip(self.params, self.spans):
            wake(p, self.full[offset:offset + n].view(p.shape))

    def keep(self, rank: int) -> None:
        """The whole part (gathered, then changed by ``load_state_dict``): this rank's chunk into the shard."""
        assert self.full is not None
        self.shard.copy_(self.full[rank * self.chunk:(rank + 1) * self.chunk])


class Block:
    """One block's parameters (see the module docstring); ``params`` are its trainable ones, in one part per dtype,
    each part's trainable parameters one gradient bucket, and its chunk on this rank (:meth:`shard_of`) what
    the optimizer steps views of."""

    def __init__(self, number: int, name: str, params: list[nn.Parameter], rank: int, ranks: int,
                 shared: frozenset[int] = frozenset()) -> None:
        self.number, self.name, self.ranks = number, name, ranks
        self.params = [p for p in params if p.requires_grad]
        # a part per dtype (a bfloat16 block's float32 router), and one for the parameters in ``shared`` (ids of
        # those several modules hold: tied weights), which mixed_precision gathers in the master's dtype
        trained: dict[tuple, list[nn.Parameter]] = {}
        frozen: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            (trained if p.requires_grad else frozen).setdefault((p.dtype, p.device, id(p) in shared), []).append(p)
        self.parts = [Part(ps, rank, ranks, key[2]) for kinds in (trained, frozen) for key, ps in kinds.items()]
        self.trained = self.parts[:len(trained)]  # each one gradient bucket, and the optimizer's pieces
        self.part_of = {id(p): part for part in self.trained for p in part.params}
        self.placeholders = [(p, torch.full((1,), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape))
                             for part in self.parts for p in part.params]
        self.live = False  # the parameters are views of the gathered parts
        self.compute: torch.dtype | None = None  # mixed_precision: the dtype gathered for use (not for reading)
        self.pinned = False  # held whole by autodist.full_parameters: releasing waits for its end
        self.release()

    def shard_of(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's chunk of the trainable part that holds ``p`` (the optimizer steps views of it)."""
        return self.part_of[id(p)].shard

    @property
    def full(self) -> torch.Tensor | None:
        """The first part whole (the trainable one where there is one), while gathered; None otherwise."""
        return self.parts[0].full

    def start(self, group: Any, reading: bool = False) -> bool:
        """Begin gathering the block (nothing if it is gathered or on its way); True if a gather began.
        ``reading``: to read it whole (a state dict, a load), in the master's dtype, whatever ``compute`` is."""
        if self.parts[0].full is not None:
            return False
        for part in self.parts:  # a tied weight in the master's dtype: each module casts its own use of it, and
            # the uses' gradients add in float32, as without shard=
            part.start(group, None if reading or part.keeps_dtype else self.compute)
        return True

    @property
    def work(self) -> Any:
        """A gather in flight, if any."""
        return next((part.work for part in self.parts if part.work is not None), None)

    def ready(self, what: str | None = None) -> None:
        """Wait for the gather (``what``: what the wait is for, the watchdog's words); the parameters become
        views of the whole block."""
        for part in self.parts:
            if part.work is not None:
                with waiting(what or f"the all-gather of the parameters of block {self.name!r} (shard='parameters')"):
                    part.work.wait()
                part.work = None
        if not self.live:
            for part in self.parts:
                part.views()
            self.live = True

    def release(self) -> None:
        """The parameters back to placeholders; the whole block is dropped (autograd keeps none of it)."""
        if self.pinned:
            return
        for part in self.parts:
            if part.work is not None:
                part.work.wait()  # a collective in flight completes on every rank
                part.work = None
            part.full = None
        for p, placeholder in self.placeholders:
            rest(p, placeholder)
        self.live = False

    def keep(self, rank: int) -> None:
        for part in self.parts:
            part.keep(rank)

    def all_params(self) -> list[nn.Parameter]:
        """Every parameter of the block, trainable and frozen."""
        return [p for part in self.parts for p in part.params]

    def held_tensors(self) -> list[torch.Tensor]:
        """This rank's chunks, the parts gathered now, the placeholders."""
        return [t for part in self.parts for t in (part.shard, part.full)] + [t for _, t in self.placeholders]

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {sum(n for part in self.parts for _, n in part.spans)} parameters)"
