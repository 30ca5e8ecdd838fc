"""The stages in the model: each rank keeps its stage's blocks, and the model's forward runs micro-batches
through the pipeline, GPipe's way, inside the user's ``model(x)`` and ``loss.backward()``.

Every rank runs the model's own forward on each micro-batch. The code around the blocks (embeddings, masks,
the final norm and head: the *root*) is held by every stage; a block another stage holds is a
:class:`~autodist.pp.stub.Stub`. On stage s > 0 the first stub hands on the activation stage s - 1 sent; on
stage s < K - 1 the forward stops after the stage's last block, whose output goes to stage s + 1. The last
stage puts the micro-batches' outputs together (:mod:`autodist.pp.micro`) and sends the output to every stage,
so that each computes the loss the user's code computes and has a value to log.

Backward reaches the output on every stage; there the micro-batches' backwards run one after another, last
first, each as soon as the gradient of its output arrives from the next stage (the last stage cuts its own),
and each sends the gradient of its input back. The root's gradients are then summed over the stages (each
stage's use of them: the embedding's on the first, the head's on the last, tied weights on both), before the
data-parallel sync sees them, so every stage holds the gradient one process would.

Example:
    >>> pipeline = setup(model, cut, stage=1, ranks=[0, 1], group=None, device=cpu, pieces=4, dim=0)
    >>> loss_fn(model(x), y).backward()   # 4 micro-batches through both stages, forward and backward
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autodist.cp.forward import context_of
from autodist.dp.grad_sync import state_of
from autodist.layers.split_grad import mark_grad, mark_split
from autodist.pp import micro, schedule, wire
from autodist.pp.cut import Cut
from autodist.pp.hollow import hollow
from autodist.pp.stub import Stub
from autodist.pp.tokens import TokensPerSample
from autodist.runtime import provenance
from autodist.runtime.position import waiting
from autodist.runtime.world import log


class _StageDone(BaseException):
    """Raised after this stage's last block has sent its output: the rest of the forward is later stages'."""


class Flight:
    """One forward's micro-batches on this stage, kept for its backward."""

    def __init__(self, rows: list[int], counts: list[float], targets: list[Any] | None = None) -> None:
        self.rows, self.counts, self.targets = rows, counts, targets
        self.micro = -1
        self.next_block = 0
        self.received: Any = None
        self.inputs: list[list[torch.Tensor]] = []  # per micro-batch: the received tensors that need a gradient
        self.sent: list[list[torch.Tensor]] = []  # per micro-batch: the tensors sent on that need one back
        self.outputs: list[Any] = []  # last stage: per micro-batch, the forward's output
        self.pending: list[Any] = []
        self.merged: micro.Merged | None = None
        self.grad_leaves: list[int] = []  # last stage: the output leaves that carry a gradient
        self.cut_grads: list[list[torch.Tensor | None]] = []  # last stage: per such leaf, its micro-batches' parts
        self.alive = self.peak = 0  # micro-batches forwarded and not yet backwarded: now, and at most
        self.total = sum(counts)  # what the micro-batches' losses are weighted over (1F1B): this replica's batch,
        # or the global batch's (Pipeline.in_global_units)

    def begin(self, m: int) -> None:
        self.micro, self.next_block, self.received = m, 0, None
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        self.inputs.append([])
        self.sent.append([])


class _Output(torch.autograd.Function):
    """The model's output on every stage: its backward runs the micro-batches' backwards."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[list], None], anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.run, ctx.count = run, len(tensors)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.run(list(grads))
        ctx.run = None
        return (None, None, *([None] * ctx.count))


class Pipeline:
    """This rank's stage of a model cut into stages (see the module docstring)."""

    def __init__(self, model: nn.Module, cut: Cut, stage: int, ranks: list[int], group: Any, device: torch.device,
                 pieces: int, dim: int, samples: Callable[..., int] | None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, norms: tuple[Any] | None = None,
                 mp_rank: int = 0) -> None:
        self.model = weakref.ref(model)
        self.cut, self.stage, self.ranks, self.group, self.device = cut, stage, ranks, group, device
        self.pieces, self.dim, self.samples, self.loss_fn = pieces, dim, samples, loss_fn
        self.lo, self.hi = cut.bounds[stage], cut.bounds[stage + 1]
        self.last = stage == cut.stages - 1
        self.flight: Flight | None = None
        self.peak = 0  # the last forward's most micro-batches held at once (activations kept for backward)
        self.unfinished = False  # loss_fn: a forward ran its backward, and its loss.backward() has not come
        self.warned: set[str] = set()
        self.tokens = TokensPerSample()  # loss_fn: each micro-batch's valid tokens a sample (a loss over tokens)
        self.order = {name: i for i, (name, _) in enumerate(model.named_parameters())}  # the whole model's
        self.gathering = True  # state_dict() fills in the other stages' blocks
        self.units_over: Any = None  # loss_fn: the data-parallel group the loss's units are global over (ep)
        self.exchanging: Any = None  # the group whose ranks exchange within each micro-batch's forward (ep)
        self.standing_in = False  # loss_fn: the last forward ran on the row of a batch this replica holds none of
        self.handles: list[Any] = []
        self.blocks = self._install(model)  # this stage's
        self._mark(model, group if norms is None else norms[0], mp_rank, norms)
        forward = model.forward  # the model's own, called on the model the weak reference gives back: the
        # registry's value must not hold its key (a WeakKeyDictionary whose value holds the model keeps it alive)
        self.inner = forward.__func__ if getattr(forward, "__self__", None) is model else forward
        self.bound = self.inner is not forward
        model.forward = torch.compiler.disable(self.forward, recursive=False)  # (see forward)
        self.handles.append(model.register_state_dict_post_hook(partial(self._dense_state)))  # torch marks the hook
        batch_norms = sorted({type(m).__name__ for m in model.modules()
                              if isinstance(m, nn.modules.batchnorm._BatchNorm)})
        if batch_norms and dist.get_rank() == 0:
            log.warning("%s normalises each micro-batch with its own statistics under pp, as GPipe does: not the "
                        "batch's (one process's) statistics; use microbatches=1 for the batch's, or GroupNorm / "
                        "LayerNorm", ", ".join(batch_norms))

    def _install(self, model: nn.Module) -> list[nn.Module]:
        """Hooks on this stage's blocks, a stand-in for every other block (its memory freed); this stage's. Both
        run outside torch.compile's graphs: each block's own forward compiles whole, between them."""
        eager = torch.compiler.disable
        modules = dict(model.named_modules())
        own: list[nn.Module] = []
        for i, name in enumerate(self.cut.names):
            block = modules[name]
            if self.lo <= i < self.hi:
                own.append(block)
                self.handles.append(block.register_forward_pre_hook(eager(partial(self._block_begins, i))))
                if i == self.hi - 1 and not self.last:
                    self.handles.append(block.register_forward_hook(eager(partial(self._stage_ends, i))))
                continue
            parent, _, child = name.rpartition(".")
            stub = Stub(i, name, self.cut.stage_of(i), block.to_empty(device="meta"), self._stub_called)
            setattr(modules[parent] if parent else model, child, stub)
        return own

    def _mark(self, model: nn.Module, group: Any, mp_rank: int, norms: tuple[Any] | None) -> None:
        """A norm over the model's gradients (clip_grad_norm_) is summed over ``group``: the stages' (and with mp,
        the model-parallel ranks') parts, each counted once: the root's on the first stage, a part every
        model-parallel rank holds alike on the first of them."""
        held = self.own_params()
        for p in model.parameters():
            split = getattr(p, "split_over", None) is not None  # an MP layer's shard
            own = id(p) in held
            if split or own:
                mark_split(p, group, (split or mp_rank == 0) and (own or self.stage == 0))
            elif norms is not None:  # with mp, every parameter's part is summed over the replica
                mark_split(p, group, mp_rank == 0 and self.stage == 0)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward: every micro-batch through this stage (see the module docstring). It runs outside
        torch.compile's graphs, as do the helpers it calls (they send and receive), but for the model's own
        forward, run per micro-batch, which compiles as the user compiled the model."""
        flight, steps, calls, training = self._begin(args, kwargs)
        before = self._root_before() if self.loss_fn is not None and training else {}
        try:
            with self._sync_held() if self.loss_fn is not None else nullcontext():
                for kind, m in steps:
                    if kind == "F":
                        self._forward_one(flight, m, calls[m], training)
                    else:
                        self._backward_one(flight, m)
                self._sends_taken(flight, steps)
            if self.loss_fn is not None and training:
                self._sum_root(before)
                self.unfinished = True
        finally:
            self.flight = None
            self.peak = flight.peak
        return self._output(flight) if self.loss_fn is None else self._loss(flight, training)

    @torch.compiler.disable
    def _begin(self, args: tuple, kwargs: dict) -> tuple[Flight, list[tuple[str, int]], list, bool]:
        """The batch cut into micro-batches, and the schedule of their forwards and backwards on this stage."""
        self._check_outputs(kwargs)
        target = kwargs.pop("target", None) if self.loss_fn is not None else None
        parts = micro.cut(args, kwargs, self._agreed_pieces(args, kwargs), self.dim, target)
        counts = [float(self.samples(*a, **k)) if self.samples is not None else float(r)
                  for (a, k), r in zip(parts.calls, parts.rows)]
        share = provenance.current()
        if share is not None and share.count == 0 and self.loss_fn is not None:  # the row of a batch this replica
            counts = [0.0] * len(counts)  # holds none of: its micro-batches' backwards (1F1B) add nothing
        flight = Flight(parts.rows, counts, parts.targets)
        self.standing_in = not any(counts)
        if self.units_over is not None and self.last and self.loss_fn is not None:
            flight.total = self._global_count(counts)
        training = torch.is_grad_enabled() and (self.loss_fn is None or self.model().training)
        steps = schedule.gpipe_forwards(len(counts)) if self.loss_fn is None or not training else \
            schedule.one_f_one_b(self.cut.stages, self.stage, len(counts))
        if self.unfinished and self.loss_fn is not None and training:
            log.warning("the last model(...) of this model, cut into stages with loss_fn (1F1B), ran its backward "
                        "in its forward, and its loss.backward() never came (a validation forward in training mode? "
                        "use model.eval() or torch.no_grad() there): the gradients it left are added to this "
                        "step's unless optimizer.zero_grad() came between")
        self.flight = flight
        return flight, list(steps), parts.calls, training

    @torch.compiler.disable
    def _sends_taken(self, flight: Flight, steps: list[tuple[str, int]]) -> None:
        with waiting(self._sends(any(kind == "B" for kind, _ in steps))):
            wire.wait(flight.pending)
        flight.pending = []

    def exchanges_over(self, group: Any) -> None:
        """The forward of each micro-batch exchanges with the other ranks of ``group`` (this stage's data-parallel
        ranks: ep's experts): every batch is cut into as many micro-batches on each of them (the fewest any of
        them can cut, one all-reduce a forward), so that each exchange meets its peers, also where the ranks hold
        different numbers of rows (a short last batch)."""
        self.exchanging = group

    @torch.compiler.disable
    def _agreed_pieces(self, args: tuple, kwargs: dict) -> int:
        pieces = micro.pieces_for(args, kwargs, self.pieces, self.dim)
        if self.exchanging is None:
            return pieces
        agreed = torch.tensor([pieces], dtype=torch.int64, device=self.device)
        with waiting("the number of micro-batches, agreed with the ranks the stage's experts exchange with"):
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.exchanging)
        return int(agreed)

    def in_global_units(self, group: Any) -> None:
        """With ``loss_fn`` (1F1B): each micro-batch's loss weighted by its samples over the global batch's, summed
        over ``group`` (the data-parallel ranks), not this replica's: the backward that runs in the forward carries
        the global loss's gradient, as where the ranks' backwards exchange gradients (ep's experts take them from
        every rank's tokens); the gradient sync then sums (``GradSync.global_units``)."""
        self.units_over = group

    def _global_count(self, counts: list[float]) -> float:
        total = torch.tensor(sum(counts), dtype=torch.float64, device=self.device)
        with waiting("the global batch's samples, summed over the data-parallel ranks (1F1B in global units)"):
            dist.all_reduce(total, group=self.units_over)
        return float(total)

    def _check_outputs(self, kwargs: dict) -> None:
        """Every block's hidden states or attentions (a Hugging Face model's output_hidden_states /
        output_attentions) cannot come from a model each rank runs only some blocks of: refused on every rank,
        before anything is sent."""
        config = getattr(self.model(), "config", None)
        asked = []
        for name in ("output_hidden_states", "output_attentions", "output_router_logits"):
            value = kwargs.get(name)
            if value if value is not None else getattr(config, name, False):
                asked.append(name)
        if asked:
            router = (" (a mixture of experts' load-balancing loss, computed from every block's router logits, is "
                      "not built with pp)" if "output_router_logits" in asked else "")
            raise ValueError(f"{' and '.join(asked)}=True asks for every block's outputs{router}, and under "
                             f"pp={self.cut.stages} each stage runs only its own blocks (stage {self.stage}: "
                             f"{', '.join(self.held_blocks())}): pass {'=False, '.join(asked)}=False (and set it so "
                             f"in the model's config), or use pp=1")

    def _sends(self, backwards: bool) -> str:
        """What a stage waits in when it waits for its sends to be taken."""
        sent = [f"activations to stage {self.stage + 1}"] if not self.last else []
        if backwards and self.stage > 0:
            sent.append(f"gradients to stage {self.stage - 1}")
        return f"stage {self.stage}'s sends of its {' and '.join(sent) or 'nothing'}"

    def _forward_one(self, flight: Flight, m: int, call: tuple[tuple, dict], training: bool) -> None:
        """Micro-batch ``m``'s forward on this stage: up to its last block's send, or (last stage) to the output,
        and with ``loss_fn`` its loss."""
        flight.begin(m)
        routing = context_of(self.model())  # cp: the micro-batch's tokens read as the forward's inputs
        try:
            with nullcontext() if routing is None else routing.micro(*call, sum(flight.rows[:m])):
                out = self.inner(self.model(), *call[0], **call[1]) if self.bound else \
                    self.inner(*call[0], **call[1])
        except _StageDone:
            out = None
        if flight.next_block != (len(self.cut.names) if self.last else self.hi):
            missing = self.cut.names[flight.next_block]
            raise ValueError(f"the model's forward never called block {missing!r}, which pp={self.cut.stages} "
                             f"gives to stage {self.cut.stage_of(flight.next_block)}: pp needs a forward that calls "
                             f"every block once, in order")
        if self.last and self.loss_fn is not None:
            target = flight.targets[m] if flight.targets is not None else None
            out = self.loss_fn(out) if target is None else self.loss_fn(out, target)
            if not isinstance(out, torch.Tensor) or out.dim() != 0:
                raise TypeError(f"loss_fn must return the micro-batch's loss, one number as a tensor (a mean over "
                                f"its samples), got {type(out).__name__}"
                                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}")
            if training and not out.requires_grad:
                raise ValueError("loss_fn returned a loss that does not depend on the model's parameters (no "
                                 "gradient reaches it)")
            if training and self.samples is None and "tokens" not in self.warned:
                self.tokens.note(out, flight.counts[m])
        flight.outputs.append(out)

    @torch.compiler.disable
    def _check_tokens(self) -> None:
        """1F1B runs each micro-batch's backward before the next one's loss exists, so it weights them by their
        samples (or samples=): a loss that is a mean over valid tokens whose count a sample differs over the step's
        micro-batches and replicas is said once, with the fix (:mod:`autodist.pp.tokens`; every last stage's
        rank calls this alike)."""
        sync = state_of(self.model())
        problem = self.tokens.settle(sync.group if sync is not None else None, self.device)
        if problem is not None:
            self.warned.add("tokens")
            log.warning("loss_fn's loss is a mean over valid tokens (labels at -100?) with %s, but pp with loss_fn "
                        "(1F1B) weights each micro-batch by its samples, which is not the one-process mean over the "
                        "batch's tokens: drop loss_fn (GPipe: the loss computed from model(x) in your loop, or by "
                        "the model itself), where autodist weights by the tokens", problem)

    def _arrive(self, index: int) -> None:
        flight = self.flight
        assert flight is not None
        if index != flight.next_block:
            expected = self.cut.names[flight.next_block] if flight.next_block < len(self.cut.names) else "none"
            raise ValueError(f"pp needs the model's forward to call each block once, in order: "
                             f"{self.cut.names[index]!r} ran where {expected!r} was next (a block called twice, "
                             f"or out of order, cannot be cut into stages); name the blocks with blocks=[...] or "
                             f"stages=[[...], ...], or use pp=1")
        flight.next_block += 1

    def _stub_called(self, index: int) -> Any:
        flight = self.flight
        name = self.cut.names[index]
        if flight is None:
            raise RuntimeError(f"{name} is held by pipeline stage {self.cut.stage_of(index)}, and this rank runs "
                               f"stage {self.stage}: call the whole model, whose forward runs the pipeline")
        self._arrive(index)
        if index >= self.lo:
            raise RuntimeError(f"{name} ran after stage {self.stage}'s last block, which should have ended its "
                               f"forward")
        if flight.received is None:
            value, description = wire.recv(self.ranks[self.stage - 1], self.group, self.device,
                                           f"stage {self.stage}'s input (micro-batch {flight.micro}) from stage "
                                           f"{self.stage - 1}")
            for t, leaf in zip(pytree.tree_leaves(value), description["leaves"]):
                if leaf[0] == "t" and leaf[3] and torch.is_grad_enabled():  # it needs a gradient sent back
                    t.requires_grad_(True)
                    flight.inputs[-1].append(t)
            flight.received = value
        # The code between this block and the next runs here, on what it returns: on the received output it
        # runs once, here, as in one process (an activation between blocks, a residual on the input the root
        # computed here); an output only an earlier stage holds is hollow, and any use of it an error.
        return hollow(flight.received, name, self.cut.stage_of(index)) if index < self.lo - 1 else flight.received

    def _block_begins(self, index: int, module: nn.Module, args: Any) -> None:
        if self.flight is not None:
            self._arrive(index)

    def _stage_ends(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        flight = self.flight
        if flight is None:
            return
        what = f"the output of {self.cut.names[index]} (stage {self.stage}'s last block)"
        flight.pending += wire.send(output, self.ranks[self.stage + 1], self.group, self.device, what)
        if torch.is_grad_enabled():
            flight.sent[-1] = [t for _, t in _tensors(output) if t.requires_grad]
        raise _StageDone

    @torch.compiler.disable
    def _output(self, flight: Flight) -> Any:
        """The model's output on every stage: merged on the last, sent to the others, tied to the backward."""
        value = count = None
        grad = torch.is_grad_enabled()
        if self.last:
            merged = micro.merge(flight.outputs, flight.rows, flight.counts, self.dim, self._dropped)
            flat, spec = pytree.tree_flatten(merged.value)
            firsts = pytree.tree_flatten(flight.outputs[0])[0]
            flight.grad_leaves = [i for i, t in enumerate(firsts) if isinstance(t, torch.Tensor) and t.requires_grad]
            flight.merged = merged
            for i in flight.grad_leaves:
                flat[i] = flat[i].requires_grad_(True) if grad else flat[i]  # said to the other stages as needing one
            value, count = pytree.tree_unflatten(flat, spec), merged.count
        value, count = wire.broadcast((value, count), self.ranks[-1], self.group, self.device,
                                      f"the model's output, from the last pipeline stage ({self.cut.stages - 1})")
        if not grad:
            return value
        sync = state_of(self.model())
        if sync is not None:
            sync.pipeline_count = count  # a loss over valid tokens: this replica's weight in the data-parallel sync
        flat, spec = pytree.tree_flatten(value)
        leaves = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not self.last:
            flight.grad_leaves = leaves
        anchor = torch.zeros((), requires_grad=True)
        tied = _Output.apply(partial(self._backward, flight), anchor, *(flat[i].detach() for i in leaves))
        for i, t in zip(leaves, tied):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    def _dropped(self, where: str, value: Any) -> None:
        if where not in self.warned:
            self.warned.add(where)
            log.warning("%s of the model's forward differs between micro-batches or cannot be sent to another "
                        "pipeline stage (a %s: a cache of attention keys?), so a model cut into stages (pp) returns "
                        "None there; a Hugging Face model takes use_cache=False", where,
                        type(value).__name__)

    # -- backward --------------------------------------------------------------------------------
    @contextmanager
    def _sync_held(self) -> Iterator[None]:
        """The data-parallel sync set aside while the micro-batches' gradients accumulate (GPipe's backward, the
        whole 1F1B step): it sends once they are summed over the micro-batches and the stages, in the backward
        that reaches the output."""
        model = self.model()
        sync = state_of(model) if model is not None else None
        if sync is None:
            yield
            return
        enabled, inside = sync.enabled, sync.in_backward
        sync.enabled = False
        sync.in_backward = True  # the micro-batches' backwards are parts of one: none ends the sync's backward
        try:
            yield
        finally:
            sync.enabled = enabled
            sync.in_backward = inside
            if self.loss_fn is not None:
                sync.grads_arrived = False  # until the backward that reaches the loss (see _finish)

    def _backward(self, flight: Flight, grads: list[torch.Tensor | None]) -> None:
        """Every micro-batch's backward on this stage, last first, as the gradients of their outputs arrive
        (GPipe: in the backward that reaches the output)."""
        if self.last and flight.merged is not None:
            flight.cut_grads = [flight.merged.cut_grad(i, g, flight.rows) for i, g in zip(flight.grad_leaves, grads)]
        before = self._root_before()
        with self._sync_held():
            for _, m in schedule.gpipe_backwards(len(flight.rows)):
                self._backward_one(flight, m)
            with waiting(self._sends(True)):
                wire.wait(flight.pending)
            flight.pending = []
        self._sum_root(before)

    @torch.compiler.disable
    def _backward_one(self, flight: Flight, m: int) -> None:
        """Micro-batch ``m``'s backward on this stage: from its output's gradient (the next stage's, or the
        loss's) to its input's, sent to the stage before."""
        if self.last and self.loss_fn is not None:
            pairs = [(flight.outputs[m], torch.tensor(flight.counts[m] / flight.total if flight.total else 0.0,
                                                      dtype=flight.outputs[m].dtype, device=flight.outputs[m].device))]
        elif self.last:
            outs = pytree.tree_flatten(flight.outputs[m])[0]
            pairs = [(outs[i], g[m]) for i, g in zip(flight.grad_leaves, flight.cut_grads)]
        else:
            outs = flight.sent[m]
            received = wire.recv_tensors(outs, self.ranks[self.stage + 1], self.group,
                                         f"the gradient of stage {self.stage}'s output (micro-batch {m}) from "
                                         f"stage {self.stage + 1}")
            pairs = list(zip(outs, received))
        pairs = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.stage > 0:
            back = [t.grad if t.grad is not None else torch.zeros_like(t) for t in flight.inputs[m]]
            flight.pending += wire.send_tensors(back, self.ranks[self.stage - 1], self.group)
        flight.sent[m], flight.inputs[m] = [], []
        flight.alive -= 1
        if self.last and self.loss_fn is None:
            flight.outputs[m] = None
        elif self.last:
            flight.outputs[m] = flight.outputs[m].detach()

    @torch.compiler.disable
    def _loss(self, flight: Flight, training: bool) -> torch.Tensor:
        """With ``loss_fn``: the batch's loss (the micro-batches' weighted by their counts) on every stage, whose
        backward has run already; the one ``loss.backward()`` after lets the data-parallel sync send."""
        loss = None
        if self.last and training and self.samples is None and "tokens" not in self.warned:
            self._check_tokens()
        if self.last:  # a stand-in's (no samples counted): its rows' mean, to log
            weights = [c / sum(flight.counts) for c in flight.counts] if sum(flight.counts) else \
                [r / sum(flight.rows) for r in flight.rows]
            loss = sum(w * out.detach() for w, out in zip(weights, flight.outputs))
        loss = wire.broadcast(loss, self.ranks[-1], self.group, self.device,
                              f"the loss, from the last pipeline stage ({self.cut.stages - 1})")
        loss = loss.detach()
        if not training:
            return loss
        anchor = torch.zeros((), requires_grad=True)
        return _Output.apply(self._finish, anchor, loss)[0]

    def _finish(self, grads: list[torch.Tensor | None]) -> None:
        """``loss.backward()`` of a model whose step ran in its forward (``loss_fn``): the gradients are there."""
        grad = grads[0]
        if grad is not None and float(grad) != 1.0 and not (float(grad) == 0.0 and self.standing_in):
            raise ValueError(f"loss.backward() reached the loss of a model cut into stages with loss_fn (1F1B) "
                             f"with a gradient of {float(grad):g}: its micro-batches' backwards ran in the forward, "
                             f"with 1; scale the loss inside loss_fn instead (for gradient accumulation, divide "
                             f"there)")
        self.unfinished = False
        model = self.model()
        sync = state_of(model) if model is not None else None
        if sync is not None:
            if not sync.enabled or sync.window.backwards:
                raise NotImplementedError("gradient accumulation (no_sync) with loss_fn (1F1B) is not built: "
                                          "each step's backward runs in its forward; use more microbatches, or the "
                                          "default schedule (no loss_fn)")
            sync.grads_arrived = True

    def _root(self) -> list[nn.Parameter]:
        """The trainable parameters every stage holds: the code around the blocks."""
        model = self.model()
        own = self.own_params()
        return [] if model is None else [p for p in model.parameters() if p.requires_grad and id(p) not in own]

    def own_params(self) -> set[int]:
        """The ids of the parameters of this stage's blocks, as they are now (ep places a slice of their experts
        in parameters of its own after the cut)."""
        return {id(p) for b in self.blocks for p in b.parameters()}

    @torch.compiler.disable
    def _root_before(self) -> dict[int, torch.Tensor]:
        """The root's gradients accumulated before this backward (under no_sync), set aside: the stages sum only
        what this backward adds. Nothing to copy in the usual loop, which zeroes them to None."""
        return {id(p): p.grad.detach().clone() for p in self._root() if p.grad is not None}

    @torch.compiler.disable
    def _sum_root(self, before: dict[int, torch.Tensor]) -> None:
        """What this backward added to the root's gradients, summed over the stages (each holds its own use of
        them), on top of what was there before; kept None where no stage gave one."""
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in self._root():
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in by_dtype.items():
            added = [None if p.grad is None else p.grad - before[id(p)] if id(p) in before else p.grad
                     for p in params]
            flat = torch.cat([*(a.reshape(-1) if a is not None else p.new_zeros(p.numel())
                                for a, p in zip(added, params)),
                              torch.tensor([float(a is not None) for a in added], dtype=dtype, device=device)])
            with waiting("the sum of the root's gradients over the pipeline stages"):
                dist.all_reduce(flat, group=self.group)
            offset = 0
            used = flat[-len(params):].tolist()
            for p, flag in zip(params, used):
                part = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
                if flag == 0:
                    continue
                total = part + before[id(p)] if id(p) in before else part
                if p.grad is None:  # set here, not by a backward: marked as a backward marks it (its part of a norm)
                    p.grad = total.clone()
                    mark_grad(p)
                else:
                    p.grad.copy_(total)

    # -- the dense state ------------------------------------------------------------------------------
    def _dense_state(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """Each block's entries from the stage that holds it (a collective over the stages)."""
        if not self.gathering:
            return
        with waiting("model.state_dict() of a model cut into stages gathers every stage's blocks: a collective, "
                     "call it on every rank"):
            for stage in range(self.cut.stages):  # each stage's entries, as they are there (dtype, device)
                starts = tuple(f"{prefix}{name}." for name in self.cut.stage_names(stage))
                mine = {k: v.detach() for k, v in state_dict.items() if k.startswith(starts)} \
                    if stage == self.stage else None
                theirs = wire.broadcast(mine, self.ranks[stage], self.group, self.device,
                                        f"stage {stage}'s blocks for model.state_dict()")
                if stage != self.stage:
                    state_dict.update(theirs)  # in the places the stand-ins kept for them

    @contextmanager
    def shapes_only(self) -> Iterator[None]:
        """``state_dict()`` without the collective: the other stages' entries stay meta tensors of their shape
        (what a checkpoint needs to know of the layout)."""
        before, self.gathering = self.gathering, False
        try:
            yield
        finally:
            self.gathering = before

    def dense_optimizer_state(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The optimizer state of the whole model on the first stage of rank 0's pipeline, from each stage's
        ``mine`` (keyed by parameter names, as a checkpoint holds it; the root's, the same on every stage, from
        the first); elsewhere ``mine``. A collective over that pipeline's stages."""
        if 0 not in self.ranks:
            return mine
        if self.stage > 0:
            what = f"stage {self.stage}'s optimizer state, for the checkpoint"
            wire.wait(wire.send(mine, self.ranks[0], self.group, self.device, what))
            return mine
        merged = {"state": dict(mine["state"]), "param_groups": [dict(g) for g in mine["param_groups"]]}
        for s in range(1, self.cut.stages):
            theirs, _ = wire.recv(self.ranks[s], self.group, self.device, f"stage {s}'s optimizer state")
            if len(theirs["param_groups"]) != len(merged["param_groups"]):
                raise ValueError(f"the optimizer of stage {s} has {len(theirs['param_groups'])} parameter groups "
                                 f"and stage 0's {len(merged['param_groups'])}: build it the same way on every rank")
            for name, entries in theirs["state"].items():
                merged["state"].setdefault(name, pytree.tree_map(
                    lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, entries))
            for group, other in zip(merged["param_groups"], theirs["param_groups"]):
                names = set(group["params"]) | set(other["params"])
                group["params"] = sorted(names, key=lambda n: self.order.get(n, len(self.order)))
        return merged

    def held_blocks(self) -> list[str]:
        return self.cut.stage_names(self.stage)


def _tensors(obj: Any) -> list[tuple[int, torch.Tensor]]:
    return [(i, t) for i, t in enumerate(pytree.tree_flatten(obj)[0]) if isinstance(t, torch.Tensor)]


_pipelines: "weakref.WeakKeyDictionary[nn.Module, Pipeline]" = weakref.WeakKeyDictionary()


def setup(model: nn.Module, cut: Cut, stage: int, ranks: list[int], group: Any, device: torch.device, pieces: int,
          dim: int, samples: Callable[..., int] | None = None,
          loss_fn: Callable[..., torch.Tensor] | None = None, norms: tuple[Any] | None = None,
          mp_rank: int = 0) -> Pipeline:
    """Cut ``model`` into its stages on this rank (see the module docstring) and run its forward as a pipeline:
    GPipe, or with ``loss_fn`` 1F1B, the whole step in the forward (:mod:`autodist.pp.schedule`). ``norms``: with
    mp, ``(the group over the replica's ranks,)``, where a norm of the model's gradients is summed (None: over
    ``group``)."""
    pipeline = Pipeline(model, cut, stage, ranks, group, device, pieces, dim, samples, loss_fn, norms, mp_rank)
    _pipelines[model] = pipeline
    return pipeline


def with_loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
    """In a world of one: ``model(x, target=y)`` is ``loss_fn(model(x), y)`` (``model(x)``: ``loss_fn(model(x))``),
    as a model cut into stages with ``loss_fn`` answers, so the same script runs in one process."""
    inner = model.forward

    def forward(*args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        out = inner(*args, **kwargs)
        return loss_fn(out) if target is None else loss_fn(out, target)

    model.forward = forward


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline ``parallelize(..., pp=K)`` set up in ``model``; None without one."""
    return _pipelines.get(model)
