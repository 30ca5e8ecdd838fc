"""Gradient synchronisation: bucketed all-reduce started from backward hooks.

Each trainable parameter gets a post-accumulate-grad hook. Parameters are
packed, in reverse registration order (the order backward produces them), into
buckets: a small first one so communication starts early, then large ones. A
bucket's all-reduce starts asynchronously as soon as its last gradient lands
and buckets always start in the same order on every rank. A callback queued
on the autograd engine waits for all of them before ``backward()`` returns, so
the optimizer never sees an unsynchronised gradient.

Weights. Every forward pass is counted (:mod:`autodist.dp.shares`: from the
sharded data where it can be, inferred otherwise) and its outputs get a hook;
a backward that reaches an output is a backward through that forward and
takes its count, so a forward that no backward follows (validation without
``no_grad``) never counts. :mod:`autodist.dp.weights` turns the counts of the
backwards since the last sync into the scale gradients are packed with. Every
bucket carries two extra slots: the count, whose all-reduced sum is N (or, when
every rank knew its N, must be), and a used-flag per parameter, so a parameter
that got no gradient on any rank keeps ``grad = None`` as in a single process.
After the all-reduce, ``p.grad`` becomes a view of the bucket (no copy back),
except after gradient accumulation, where the bucket is copied back into
autograd's tensors (see ``Bucket.unpack``). The buffers training changed
(BatchNorm's statistics) ride in the last bucket (:mod:`autodist.dp.buffer_sync`).
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp import abandoned, batch_norm, loss_watch, same_batch
from autodist.dp.buckets import COPY_BACK_BELOW_BYTES, MB, Bucket, assign_buckets, average_
from autodist.dp.buffer_sync import BufferSync
from autodist.dp.exchange import AllReduce, Exchange
from autodist.dp.exchange import choose as choose_exchange
from autodist.dp.loss_reading import Balance, Reading, Term
from autodist.dp.replicate import first_difference, model_tensors, signature
from autodist.dp.shares import Counted, SampleCounter, combine, watch_outputs
from autodist.dp.structure import Watch
from autodist.dp.weak_hooks import on_grad_accumulated
from autodist.dp.weights import Pack, Window
from autodist.faults import elastic, watchdog
from autodist.layers import shared_reduce
from autodist.runtime import plain, provenance
from autodist.runtime.compiled import unwrapped
from autodist.runtime.held import Held
from autodist.runtime.position import waiting
from autodist.runtime.world import log


class Scatter(Protocol):
    """Buckets each rank keeps only its part of the sum of (``shard="gradients"``: :mod:`autodist.sharded.scatter`)."""

    def assign(self, params: list[nn.Parameter], caps: tuple[int, int]) -> list[list[int]]: ...

    def bucket(self, params: list[nn.Parameter], extra: int) -> Bucket: ...

    def choose(self, buckets: list[Bucket], group: dist.ProcessGroup | None) -> Any: ...

    def backward_ended(self) -> None: ...


class GradSync:
    """The gradient synchronisation state of one parallelized model."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, *, hooks: bool,
                 first_bucket_mb: float = 1.0, bucket_mb: float = 25.0, sync_buffers: bool = True,
                 counter: SampleCounter | None = None, scatter: Scatter | None = None,
                 own: frozenset[int] = frozenset()) -> None:
        self.elastic = elastic.current()  # under autodist run --elastic: summed over the ranks alive together
        self.group = group if self.elastic is None else self.elastic.group
        self.failed: BaseException | None = None  # elastic: this sync's all-reduce failed (a rank was lost)
        self.scatter = scatter  # shard="gradients": buckets reduce-scattered, each rank keeps its part
        self.hooks = hooks
        self.caps = (int(first_bucket_mb * MB), int(bucket_mb * MB))
        # the parameters summed here: not those each rank holds its own of (expert parallelism's experts)
        self.named = [(n, p) for n, p in model.named_parameters() if id(p) not in own]
        self.model = weakref.ref(model)
        self.counter = counter or SampleCounter()
        self.buffer_sync = BufferSync(model, sync_buffers, keep=self.elastic is not None)
        self.enabled = True  # False inside no_sync()
        self.window = Window()  # the backwards since the last sync
        self.previous_total = 1.0  # G: last sync's global count, the same on every rank
        self.last_counted: Counted | None = None  # the last sync's count, for a backward that reached no output
        self.warned_uncounted = self.warned_compiled = False
        self.compiled = False  # a forward of the model was traced by torch.compile
        # counted and its loss read at a compiled forward's end too (one graph break there): where the loss is
        # computed eagerly even inside a compiled forward (context parallelism routes it out of the graph)
        self.counts_compiled = False
        self.next_bucket = 0
        self.packing: Pack | None = None  # this backward's packing, fixed when its first bucket starts
        self.in_backward = False  # a backward through the model began and has not reached its end
        self.reached: list[Counted] = []  # the forwards this backward went through
        self.read_loss = False  # this backward's count was read from its loss (loss_reading): one for it all
        self.warned_terms = self.warned_unseen = False
        self.coupled = 0  # BatchNorm layers normalizing by the global batch (couple_batch_norm)
        self.warned_balance = self.warned_whole = False  # once each: a rank whose share is 0 drops a coupled term
        self.last_reading: Reading | None = None  # the loss of the last backward watched (for the check's message)
        self.last_backwards = 0  # backwards the last sync added up
        self.checker: Any = None  # parallelize(check=...): autodist.dp.check.Checker, kept alive here
        self.pipeline_count: float | None = None  # pp: the merged loss's tokens, set by the pipeline's forward
        self.standing_in = False  # the forward running now is a stand-in's (its rank holds no row of the batch)
        self.grads_arrived = False  # this backward brought gradients to the parameters
        self.finishers: list[Callable[[], None]] = []  # run where a backward's sync ends (ep's sum over replicas)
        self.units_share: float | None = None  # global units (context parallel): this backward's D_r / D
        self.prescale_handles: list[Any] = []
        self.param_handles: list[Any] = []
        self.structure = Watch(model, list(model.parameters()))  # the ones each rank holds its own of too
        self._build()
        if self.elastic is not None:
            self.buffer_sync.keep_counts()
        self._ready_exchange()  # now, inside parallelize (a collective), so that its summary line can say which
        # first: before shard="parameters" gathers the root (under mixed_precision in another dtype)
        # (under shard="parameters" outside torch.compile's graphs: it reads the parameters, at rest there)
        on_forward = torch.compiler.disable(self._on_forward) if getattr(scatter, "at_rest", False) \
            else self._on_forward
        self.handles = [model.register_forward_pre_hook(on_forward, prepend=True, with_kwargs=True),
                        model.register_forward_hook(self._count_forward, with_kwargs=True)]

    def _build(self) -> None:
        """Buckets and hooks for the parameters that are trainable now."""
        named = [(n, p) for n, p in self.named if p.requires_grad]
        self.built_for = self._layout()
        self.names = {p: n for n, p in named}
        self.params = [p for _, p in named]
        groups = assign_buckets(self.params, *self.caps) if self.scatter is None else \
            self.scatter.assign(self.params, self.caps)
        last = self.params[groups[-1][0]] if groups else None
        self.buffer_slots = self.buffer_sync.carry(last.dtype, last.device) if last is not None else 0
        extra = self.buffer_slots + same_batch.SLOTS if last is not None else 0  # the buffers, then the batch's mark
        make = Bucket if self.scatter is None else self.scatter.bucket
        self.buckets = [make([self.params[i] for i in idx], extra if k == len(groups) - 1 else 0)
                        for k, idx in enumerate(groups)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        # Chosen at the next sync (_ready_exchange): choosing is a collective, and a rebuild happens in a forward,
        # which need not be one every rank runs; dropping the old one first frees its shared memory.
        self.exchange: Exchange | None = None
        small = sum(p.numel() * p.element_size() for p in self.params) < COPY_BACK_BELOW_BYTES
        for bucket in self.buckets:
            bucket.copies_back = small
        for handle in self.param_handles:
            handle.remove()
        self.param_handles = [on_grad_accumulated(p, self._on_grad_ready) for p in self.params]
        if self.scatter is not None:  # a sharded gradient left from the last sync leaves .grad before autograd adds
            self.param_handles += [p.register_hook(partial(_carry, self.bucket_of[p], p)) for p in self.params]

    # -- forward: count, and watch the outputs --------------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        loss_watch.disarm()  # the last forward's loss was read, or never will be
        self.pipeline_count = None
        if not torch.compiler.is_compiling():  # coupled layers and loss terms count this forward's rows
            share = provenance.current()
            self.standing_in = self.counter(args, kwargs).stand_in if self.coupled else \
                share is not None and share.count == 0
        if not torch.is_grad_enabled():
            return
        self._recheck_structure()
        if self.in_backward:
            self._discard_aborted_backward()
        if self._layout() != self.built_for:
            # requires_grad changed since parallelize (unfreezing a layer, say), or dtype or device
            # (model.double(), model.to(...)): every rank must make the same change, as it would to its
            # optimizer, and the buckets follow (a float32 bucket would round a float64 model's gradients)
            if dist.get_rank() == 0:
                log.info("the model's trainable parameters changed (which ones, their dtype or device): "
                         "gradient buckets rebuilt")
            self._build()

    def _recheck_structure(self) -> None:
        """Refuse parameters registered since parallelize; find the buffers' modules again. Cheap unless
        something was registered somewhere; never inside a compiled forward (the end of its backward looks)."""
        if self.structure.moved():
            self.structure.check()
            model = self.model()
            if model is not None:
                self.buffer_sync.find_owners(model)

    def _ready_exchange(self) -> Exchange:
        """How this layout's buckets are summed, chosen with the other ranks (at the first sync after a build:
        every rank reaches that in the same order relative to its other collectives)."""
        if self.elastic is not None and self.group is not self.elastic.group:  # ranks joined at the last boundary
            self.group, self.exchange = self.elastic.group, None
        if self.exchange is None and self.elastic is not None:  # a rank may die mid-sum: never shared memory
            self.exchange = AllReduce([b.flat for b in self.buckets], self.group)
        if self.exchange is None:
            with waiting("exchange"):
                self.exchange = choose_exchange([b.flat for b in self.buckets], self.group) if self.scatter is None \
                    else self.scatter.choose(self.buckets, self.group)
            for index, bucket in enumerate(self.buckets):
                bucket.move_into(self.exchange.place(index, bucket.flat))
        return self.exchange

    def _layout(self) -> tuple:
        """What the buckets are built from: each parameter's requires_grad, dtype and device."""
        return tuple((p.requires_grad, p.dtype, p.device) for _, p in self.named)

    def _count_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Count this forward's samples; a backward that reaches its output takes that count.

        In a forward torch.compile traces, nothing: the count reads Python state dynamo cannot trace (where the
        input tensors came from), and the hook would break the graph at every step. The backward then takes
        the count of the sharded DataLoader's current batch (:meth:`_fallback_count`), as for a backward that
        reached no output of the model."""
        if not torch.is_grad_enabled():
            return
        if torch.compiler.is_compiling():
            self.compiled = True
            if self.counter.samples is not None or self.counts_compiled:  # one graph break
                self._count_compiled(args, kwargs, output)
            return
        watch_outputs(output, lambda: self.counter(args, kwargs), self._reached)
        if self.counter.samples is None and not self.compiled:
            loss_watch.arm(self._on_read)  # to read what the loss computed from this output is a mean over

    @torch.compiler.disable
    def _count_compiled(self, args: tuple, kwargs: dict, output: Any) -> None:
        """``samples=fn`` under torch.compile: ``fn`` of this forward's arguments, run eagerly at the forward's
        end (dynamo breaks the graph there, once a forward), so that its backward takes the user's count; or,
        with ``counts_compiled``, the forward counted and its loss read as uncompiled."""
        watch_outputs(output, lambda: self.counter(args, kwargs), self._reached)
        if self.counter.samples is None:
            loss_watch.arm(self._on_read)

    def _reached(self, counted: Counted, grad: torch.Tensor) -> torch.Tensor | None:
        """A backward reached an output of a forward counted ``counted``; a stand-in's output passes zeros on
        (its rank holds no row of the batch: nothing of it may reach a parameter, or a layer coupling the ranks'
        rows in backward)."""
        if not self.in_backward:
            self._begin_backward(counted)
        elif not self.read_loss and all(c is not counted for c in self.reached):
            self.reached.append(counted)  # a second forward in the same backward (its batch counts once)
        return torch.zeros_like(grad) if counted.stand_in and grad is not None else None

    def _begin_backward(self, counted: Counted) -> None:
        """Fix this backward's weight before any of its gradients reaches a parameter."""
        self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        counted = self._read_loss(counted)
        if self.units_share is not None:  # the backward carries the global loss's gradient: every rank counts alike
            self.units_share = (counted if counted.total is not None else self._count_globally(counted)).weight
            counted = Counted(1.0, self._group_size(), counted.batch, mark=counted.mark)
        if self.hooks and counted.total is None and (not self.enabled or self.window.backwards):
            counted = self._count_globally(counted)  # accumulating: this micro-batch needs its own N now
        self.reached = [counted]
        factor = self.window.factor(counted)
        alone = self.hooks and self.enabled and not self.window.backwards  # synced right after: packing scales it
        if factor != 1.0 and not alone:
            self.prescale_handles = [p.register_hook(partial(_prescale, factor)) for p in self.params]

    def _read_loss(self, counted: Counted) -> Counted:
        """The backward's count from its loss where that divides by what the data does not give: valid tokens,
        a mask's count (:mod:`autodist.dp.loss_reading`). That ``D_r`` is summed over the ranks at the sync (or,
        accumulating, now); a rank's stand-in row for a batch it holds no row of still counts zero. Every rank
        runs the same loss code, so all take this path alike."""
        reading = loss_watch.pending()
        if (reading is None or reading.count is None) and self.pipeline_count is not None:
            reading = Reading((Term("tokens", self.pipeline_count, "the pipeline's merged loss"),))
        if reading is None and loss_watch.unwatched() and self.counter.samples is None and not self.warned_unseen:
            self.warned_unseen = True
            log.warning("autodist did not see this backward's loss: a torch function mode (%s) was active when the "
                        "model's forward ended, and autodist reads the loss through one of its own only where no "
                        "other is. The ranks are weighted by their samples, which is the one-process training only "
                        "for a loss that is a mean over samples: for a mean over tokens (labels at -100), end that "
                        "mode's block before the loss, or pass parallelize(..., samples=fn) counting what the loss "
                        "divides by", loss_watch.unwatched())
        if reading is None or reading.count is None or self.counter.samples is not None:
            return counted
        self.read_loss = True
        why = reading.disagreement()
        if why is not None and not self.warned_terms:
            self.warned_terms = True
            log.warning("%s. Give each term its own weight by hand (docs/data-parallel.md, losses that couple the "
                        "batch)", why)
        count = 0.0 if counted.total is not None and counted.count == 0 else reading.count
        return Counted(count, None, counted.batch, mark=counted.mark, guess=counted.total)

    def couple_batch_norm(self) -> int:
        """Give the model's BatchNorm layers the global batch's statistics (:mod:`autodist.dp.batch_norm`);
        how many it has. Where it has any, the backward runs in the global loss's units (:meth:`global_units`:
        the caller scales the model's outputs)."""
        model = self.model()
        assert model is not None
        self.coupled = batch_norm.install(model, lambda: self.group, lambda: self.standing_in, self._all_reduce)
        return self.coupled

    def global_units(self) -> Callable[[], float]:
        """Where the ranks' backwards exchange gradients with each other (context parallelism: a rank's keys and
        values take the gradients of every rank's queries; expert parallelism: a rank's experts, of every rank's
        tokens; BatchNorm: a rank's rows, of every rank's through the batch's statistics), each must carry the
        gradient of the *global* loss:
        its loss's gradient multiplied by ``D_r / D`` (``D_r`` what its loss divides by, read from it or
        counted, ``D`` their sum over the ranks; zero for a rank with nothing to divide by, whose keys still
        pass the others' gradients on), and the sync then sums the ranks' gradients (every rank counts alike,
        ``1 / W``, and the sum is multiplied by ``W``: a float32 part of the model, Hugging Face's RMSNorm,
        then sees one process's numbers, not ones ``W`` times larger that round differently). Returns that
        factor, for the backward running now: the caller multiplies the model's outputs' gradients by it."""
        self.units_share = 0.0
        return self.backward_weight

    def _group_size(self) -> int:
        return dist.get_world_size(self.group)

    def backward_weight(self) -> float:
        """The share of the global batch's gradient this rank's backward running now brings (its gradients are
        multiplied by it before they are summed): what a layer or a loss term coupling the ranks in backward
        scales by. Where the share is summed over the ranks at the sync (a count read from the loss), it is
        summed now, once: every rank's backward comes here alike."""
        if not self.in_backward:  # a coupled layer's backward before any output or gradient of the model's
            self._begin_backward(self._unweighted(self._fallback_count()))
        if self.units_share is not None:
            return self.units_share
        counted = combine(self.reached)
        if counted.total is None:
            counted = self._count_globally(counted)
            self.reached = [counted]
        return counted.weight

    def _on_read(self, reading: Reading) -> list:
        """The loss of a backward about to run (:mod:`autodist.dp.loss_watch`): a load-balancing term gets the
        global batch's statistics in its gradient (:meth:`_balance`); the hooks, removed after that backward."""
        self.last_reading = reading
        return [b.node.register_hook(partial(self._balance, b)) for b in reading.balances]

    def _balance(self, term: Balance, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        """The gradient of a load-balancing term ``sum(f * p_mean)`` to ``p``'s mean, as the one-process loss
        has it: ``f`` the global batch's (the ranks' statistics averaged over their rows), and this rank's mean
        weighted by its rows' share of the batch's. Divided by the rank's share of the sync (the sync multiplies
        by it), so the term keeps its own weight beside the loss's other terms."""
        weight = self.backward_weight()
        rows = 0.0 if self.standing_in else term.rows
        counts = term.statistic.double() * rows
        if torch.allclose(counts, counts.round(), rtol=0, atol=1e-4):  # counts of routed tokens: exact integers
            counts = counts.round()
        both = torch.cat([counts.flatten(), counts.new_tensor([rows])])
        with waiting("the load-balancing loss's statistics over the global batch"):
            self._all_reduce(both)
        total = float(both[-1])
        statistic = (both[:-1].to(term.statistic.dtype) / total).view(term.statistic.shape)
        grad = grad_inputs[term.index]
        if weight == 0.0 or rows == 0.0 or grad is None:
            if rows > 0.0 and not self.warned_balance:
                self.warned_balance = True
                log.warning("a rank whose rows hold no token its loss counts (every label -100) still routed them: "
                            "its part of the load-balancing loss is left out of this step's gradient")
            new = None if grad is None else torch.zeros_like(grad)
        else:
            new = (grad_outputs[0] * statistic * (rows / total / weight)).sum_to_size(grad.shape).to(grad.dtype)
        return tuple(new if i == term.index else g for i, g in enumerate(grad_inputs))

    def _count_globally(self, counted: Counted) -> Counted:
        """N of a micro-batch whose N this rank cannot know: one all-reduce of the counts."""
        device = self.params[0].device if self.params else torch.device("cpu")
        total = torch.tensor([counted.count], dtype=torch.float64, device=device)
        with waiting("count"):
            self._all_reduce(total)
        n = float(total)
        if math.isnan(n):
            self._raise_uncounted(counted.error)
        return Counted(counted.count, n, None, mark=counted.mark)

    def _all_reduce(self, t: torch.Tensor) -> None:
        """A few numbers summed over the data-parallel ranks in backward (a count, a loss term's statistics):
        through shared memory on one machine (tens of microseconds, where gloo took milliseconds), except in
        an elastic job, where a rank may die mid-sum: then ``t`` keeps this rank's numbers and the sync at the
        end of the window abandons the step (:meth:`_agreed`)."""
        if self.elastic is None:
            shared_reduce.all_reduce(t, self.group, "sums")
        elif self.failed is None:  # a rank lost: the window's sync abandons the step, and this sum is moot
            try:
                self.elastic.sum_(t)  # or raises once a rank that saw the loss gave the window's sync up
            except Exception as exc:  # noqa: BLE001 - a peer's connection reset, or the group's timeout
                self.failed = exc

    def _fallback_count(self) -> Counted:
        """The count of a backward that reached no output of the model (it called a submodule, say)."""
        share = provenance.current()
        if share is not None:
            if self.compiled and not self.warned_compiled:
                self.warned_compiled = True
                if dist.get_rank() == 0:
                    log.warning(
                        "the model's forward runs compiled (torch.compile), where autodist reads nothing of the "
                        "loss: each rank is weighted by its samples, exact for a loss that is a mean over samples. "
                        "For a mean over tokens (labels at -100, a mask) pass parallelize(..., samples=fn) with "
                        "fn(*args, **kwargs) counting them in the forward's arguments (one graph break at the "
                        "forward's end), or compile the model's layers (model.layers[i] = torch.compile(...)) "
                        "rather than the whole model")
            return self.counter.of_share(share)
        if self.last_counted is not None:
            return self.last_counted
        if not self.warned_uncounted:
            self.warned_uncounted = True
            why = "its forward runs compiled (torch.compile), where autodist does not count samples" \
                if self.compiled else "a submodule called directly?"
            log.warning("a backward reached the model's parameters without passing through an output of its "
                        "forward (%s) and no sharded DataLoader batch is current: the ranks are weighted equally, "
                        "which is exact only if they hold equal numbers of samples; train from the DataLoader "
                        "parallelize returns, whose batches carry their share", why)
        return Counted(1.0)

    def _unweighted(self, counted: Counted) -> Counted:
        """``counted``, or a count that fails the sync, naming why, where the backward needed a weight of its own
        before autograd added its gradients: it reached no output of the model, so nothing scaled them."""
        accumulating = not self.enabled or self.window.backwards
        if not accumulating or math.isnan(counted.count) or self.window.factor(counted) == 1.0:
            return counted
        how = "its forward ran compiled (torch.compile)" if self.compiled else "it reached no output of the model"
        return Counted(math.nan, error=(
            f"a backward of this accumulation window holds a different share of its global batch than the first "
            f"(an uneven last batch?), and {how}, so autodist could not weight its gradients before autograd added "
            f"them: use drop_last=True, or compile the model's layers (model.layers[i] = torch.compile(...)) "
            f"rather than the whole model, whose forward autodist then counts"))

    # -- backward: prescale, buckets, end --------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.in_backward:  # a backward that did not pass through the model's output (a submodule's)
            self.in_backward = True
            self.reached = [self._unweighted(self._read_loss(self._fallback_count()))]
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grads_arrived = True
        if not (self.enabled and self.hooks):
            return
        bucket = self.bucket_of[p]
        if bucket.sent:
            raise RuntimeError(
                f"parameter {self.names[p]!r} received a second gradient after its bucket was already sent "
                f"in this backward pass (reentrant checkpointing does this); use "
                f"torch.utils.checkpoint with use_reentrant=False, or parallelize(..., sync='manual')")
        bucket.ready.add(id(p))
        while self.next_bucket < len(self.buckets) and \
                len(self.buckets[self.next_bucket].ready) == len(self.buckets[self.next_bucket].params):
            self._start(self.next_bucket)
            self.next_bucket += 1

    def _end_of_backward(self) -> None:
        # a backward that brought no gradient (torch.autograd.grad for a gradient penalty) adds nothing
        self.in_backward = self.read_loss = False
        self._remove_prescale()
        if self.compiled:  # its forward looked at nothing
            self._recheck_structure()
        if self.grads_arrived:
            self.grads_arrived = False
            if self.packing is None:  # not added yet by the first bucket
                self.window.add(combine(self.reached))
            self.reached = []
            if self.enabled and self.hooks:
                self.flush()
        self.reached = []
        if self.scatter is not None:
            self.scatter.backward_ended()
        if self.enabled and self.hooks:
            for finish in self.finishers:
                finish()

    def _remove_prescale(self) -> None:
        for handle in self.prescale_handles:
            handle.remove()
        self.prescale_handles = []

    def _discard_aborted_backward(self) -> None:
        """A backward that raised never reached its end-of-backward callback: drop what it left half done."""
        log.warning("the previous backward pass did not finish (it raised?): its half-done gradient sync is "
                    "discarded, and what it left in .grad is not a synchronized gradient: call "
                    "optimizer.zero_grad() before the next backward")
        self._reset_buckets()
        self._remove_prescale()
        self.window.reset()
        self.in_backward = self.grads_arrived = self.read_loss = False
        self.reached = []

    def _reset_buckets(self) -> None:
        if self.exchange is not None:
            self.exchange.abandon()  # every rank started the same buckets before failing alike
        for bucket in self.buckets:
            bucket.sent = False
            bucket.ready.clear()
        self.next_bucket, self.packing = 0, None
        self.buffer_sync.sent = None

    # -- the sync ------------------------------------------------------------------------------
    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.packing is None:  # the first bucket of this sync: the window is complete
            if self.in_backward:
                self.window.add(combine(self.reached))
            self.packing = self.window.pack(self.previous_total)
        exchange = self._ready_exchange()
        exchange.claim(index)
        if bucket is self.buckets[-1]:
            if self.buffer_slots:
                self.buffer_sync.pack(bucket.extra[:self.buffer_slots], self.packing.count)
            same_batch.pack(bucket.extra[self.buffer_slots:], self.window.mark, dist.get_world_size(self.group))
        part = exchange.own(index) if self._copies_back() else None  # only where the sums are copied back
        own = bucket.pack(self.packing.count, self.packing.scale, part)  # see dp/own_part.py
        bucket.sent = True
        if self.elastic is None:
            exchange.send(index, bucket.flat, own)
        elif self.failed is None:
            try:
                exchange.send(index, bucket.flat, own)
            except Exception as exc:  # noqa: BLE001 - the group lost a rank: the agreement at the end says abort
                self.failed = exc

    def flush(self) -> None:
        """Send what is not sent yet, wait for everything, and leave averaged gradients in ``.grad``."""
        if not self.window.backwards and self.packing is None:  # nothing counted: synchronize_model by hand
            self.window.add(self._fallback_count())
        for index in range(self.next_bucket, len(self.buckets)):
            self._start(index)
        exchange = self._ready_exchange()
        with waiting("sync"):  # the watchdog names the ranks that never arrive
            if self.elastic is None:
                exchange.finish()
            elif not self._agreed(exchange):
                return  # abandoned: no rank applies this step (see autodist.faults.elastic)
        packing = self.packing
        assert packing is not None or not self.buckets
        total = self.buckets[0].total() if self.buckets else packing.count if packing else 0.0
        if math.isnan(total):
            error = self.window.error
            self._reset_buckets()
            self.window.reset()
            self._raise_uncounted(error)
        if self.buckets:
            try:
                same_batch.check(self.buckets[-1].summed_extra()[self.buffer_slots:])
            except RuntimeError:
                self._reset_buckets()
                self.window.reset()
                raise
        correction = 1.0 if self.units_share is None else float(self._group_size())  # global units: a sum
        if packing is not None and packing.expected is None:
            correction = packing.previous_total / total if total > 0 else 0.0
            if total > 0:
                self.previous_total = total
        elif packing is not None and total != packing.expected:
            log.warning("the ranks' sample counts add up to %g, but every rank's batch said %g: the ranks are "
                        "not on the same global batch (a loop that takes batches ahead of their step?); this "
                        "step's gradient is not the single-process one", total, packing.expected)
        for bucket in self.buckets:
            bucket.unpack(correction, copy_back=self._copies_back())
        rode = self.buffer_sync.sent is not None
        if rode:
            self.buffer_sync.unpack(self.buckets[-1].summed_extra()[:self.buffer_slots], total)
        self.buffer_sync.average_rest(packing.count if packing else 1.0, self.group, rode)
        self.last_counted = Counted(self.window.count, self.window.total) if self.window.backwards else None
        self.last_backwards = self.window.backwards
        self.window.reset()
        self.next_bucket, self.packing = 0, None

    def _agreed(self, exchange: Exchange) -> bool:
        """Elastic: whether every rank applies this sync; if not, the step is abandoned here, the ranks left
        regroup, and the next sync goes over them."""
        assert self.elastic is not None and isinstance(exchange, AllReduce)
        if self.failed is None:
            try:
                self.elastic.wait_for(exchange.works)  # or until another rank gave this sync up
                exchange.finish()
            except Exception as exc:  # noqa: BLE001 - a peer's connection reset, or the group's timeout
                self.failed = exc
        if self.elastic.agree(self.failed is None):
            abandoned.committed()
            self.buffer_sync.keep_counts()
            return True
        failed, self.failed = self.failed, None
        self.exchange = None  # its all-reduce may still hold the buckets: new ones are built below
        self.window.reset()
        self.next_bucket, self.packing = 0, None
        for p in self.params:
            p.grad = None
        self.buffer_sync.restore()
        self.elastic.regroup(failed)
        self.group = self.elastic.group
        self._build()
        abandoned.mark()
        return False

    def _copies_back(self) -> bool:
        """Whether this sync copies the sums back into autograd's gradients: after accumulation (see
        Bucket.unpack)."""
        return self.window.backwards > 1

    def _raise_uncounted(self, mine: str | None) -> None:
        raise ValueError(mine or f"autodist cannot count the samples of this step on another rank (see that rank's "
                                 f"error); rank {dist.get_rank()} could count its own")

    def held(self) -> Held:
        """What this sync keeps beside the model (buckets, shared memory, the buffers' snapshot), for
        ``autodist.memory``."""
        held = Held()
        for bucket in self.buckets:
            bucket.held(held)
        reducer = shared_reduce.reducer_of(self.group, "sums")
        if reducer is not None:  # the counts', BatchNorm's and loss terms' all-reduces
            reducer.held(held)
        if self.exchange is not None:
            self.exchange.held(held)
        self.buffer_sync.held(held)
        return held

    def forget_buffers(self) -> None:
        """Count every buffer as changed at the next sync (its state before is unknown)."""
        self.buffer_sync.forget()

    def remove(self) -> None:
        for handle in [*self.handles, *self.param_handles]:
            handle.remove()
        self._remove_prescale()


def _carry(bucket: Bucket, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    bucket.carry(p)
    return grad


def _prescale(factor: float, grad: torch.Tensor) -> torch.Tensor:
    """A micro-batch's gradient times its weight relative to the window's; an empty one (NaN loss) gives zero."""
    return torch.zeros_like(grad) if factor == 0.0 else grad * factor


@dataclass
class Registration:
    """What parallelize set up for a model: its data-parallel layout and, if any, its sync state."""

    dp: int  # data-parallel ranks
    dp_rank: int  # this rank's index among them
    dp_group: dist.ProcessGroup | None  # None: the whole world
    sync: GradSync | None


_registry: "weakref.WeakKeyDictionary[nn.Module, Registration]" = weakref.WeakKeyDictionary()
_unparallelized: "weakref.WeakKeyDictionary[nn.Module, Registration]" = weakref.WeakKeyDictionary()


def attach(model: nn.Module, registration: Registration) -> None:
    model = unwrapped(model)
    if model in _registry:
        raise RuntimeError("this model is already parallelized; call autodist.parallelize once per model")
    _registry[model] = registration


def is_parallelized(model: nn.Module) -> bool:
    return registration_of(model) is not None


def registration_of(model: nn.Module) -> Registration | None:
    """The data-parallel layout parallelize gave ``model`` (or the model ``torch.compile`` wrapped in it);
    None if it was not parallelized."""
    return _registry.get(unwrapped(model))  # torch.compile's wrapper, before or after parallelize: its model


def parallelized() -> list[nn.Module]:
    """The models ``parallelize`` set up in this process and still alive."""
    return list(_registry.keys())


def state_of(model: nn.Module) -> GradSync | None:
    registration = registration_of(model)
    return registration.sync if registration is not None else None


def _check_model_arg(model: Any, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found ({model!r:.60}): "
                        f"autodist.{function} takes the model passed to autodist.parallelize")


def no_sync(model: nn.Module) -> ContextManager[None]:
    """Accumulate gradients locally: backward passes inside the block send no gradients.

    The next backward outside the block (or ``synchronize_model``) sends
    everything accumulated. Each micro-batch's gradient is weighted by this
    rank's share of that micro-batch, so the result equals one process
    accumulating the same global micro-batches, also when the shares differ
    (a short last batch). The shares of batches from the DataLoader that
    ``parallelize`` sharded are known; otherwise each backward inside the
    block, and the backward after it that syncs, first all-reduces its
    micro-batch's sample count (one number, waited for), so every rank must
    run the same backwards.

    Example:
        >>> with autodist.no_sync(model):
        ...     loss_fn(model(x1), y1).backward()   # no gradient sent
        >>> loss_fn(model(x2), y2).backward()       # syncs the weighted sum of both

    Note:
        Exact with one forward per backward, the usual loop. A world of one, or
        a model that was not parallelized, makes this a no-op.
    """
    _check_model_arg(model, "no_sync")
    return _no_sync(model)


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    sync = state_of(model)
    if sync is None:
        yield
        return
    previous, sync.enabled = sync.enabled, False
    try:
        yield
    finally:
        sync.enabled = previous


def synchronize_model(model: nn.Module, what: Literal["gradients", "parameters"] = "gradients") -> None:
    """Average gradients, or the weights themselves, across the data-parallel ranks now.

    Args:
        model: a model passed to ``autodist.parallelize`` (or any model that is the
            same on every rank).
        what: "gradients" leaves in ``.grad`` the gradient of the global batch
            (each rank weighted by the samples it saw since the last sync);
            "parameters" replaces parameters and floating-point buffers by their
            plain average over ranks (the "update locally, then average" mode).

    Example:
        >>> model, data = autodist.parallelize(model, data, sync="manual")
        >>> loss_fn(model(x), y).backward()
        >>> autodist.synchronize_model(model)      # gradients now as in one process
        >>> optimizer.step()

    Note:
        Every rank must call it, the same number of times. In a world of one, or
        with no data parallelism (every rank in one model-parallel group), it
        does nothing.
    """
    from autodist.runtime.world import init

    _check_model_arg(model, "synchronize_model")
    if not isinstance(what, str):
        raise TypeError(f"autodist.synchronize_model: what must be the string 'gradients' or 'parameters', "
                        f"got {type(what).__name__} {what!r:.60}")
    if what not in ("gradients", "parameters"):
        raise ValueError(f"autodist.synchronize_model: what must be 'gradients' or 'parameters', got {what!r}")
    world = init()
    if world.size == 1:
        return
    registration = _registry.get(model) or _unparallelized_registration(model, world)
    if registration.dp == 1:
        return
    if what == "parameters":  # not those each rank holds its own of (expert parallelism's experts)
        synced = None if registration.sync is None else {id(p) for _, p in registration.sync.named}
        params = [p for p in model.parameters() if synced is None or id(p) in synced] + \
            [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad(), waiting("parameters"):
            average_([p.data for p in params], 1.0, registration.dp_group)
        return
    if registration.sync is None:
        registration.sync = GradSync(model, None, hooks=False)
        registration.sync.forget_buffers()  # the forward before this call may have changed them already
    registration.sync.flush()


def _unparallelized_registration(model: nn.Module, world: Any) -> Registration:
    """A model synchronized without parallelize: the user keeps it identical on all ranks, which is checked
    once (a model that differs would make the ranks' messages differ, and gloo abort). Kept apart from
    _registry, so that parallelize(model) later is still allowed."""
    from autodist.runtime.environment import busy_timeout, hang_timeout

    registration = _unparallelized.get(model)
    if registration is None:
        watchdog.start(world.rank, world.size, hang_timeout(), busy_timeout())
        mine = signature(model_tensors(model))
        with waiting("autodist.synchronize_model's check that the ranks hold the same model"):
            gathered = plain.all_gather(mine)
        why = next((d for r, sig in enumerate(gathered) if (d := first_difference(gathered[0], sig, r))), None)
        if why is not None:
            raise ValueError(f"autodist.synchronize_model: the ranks hold different models ({why}), so their "
                             f"gradients cannot be averaged. Build the same model on every rank, or pass it "
                             f"through autodist.parallelize, which also starts every rank from rank 0's weights")
        registration = _unparallelized[model] = Registration(world.size, world.rank, None, None)
    return registration
