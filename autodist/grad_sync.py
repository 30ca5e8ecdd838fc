"""Gradient synchronisation: bucketed all-reduce started from backward hooks.

Each trainable parameter gets a post-accumulate-grad hook. Parameters are
packed, in reverse registration order (the order backward produces them), into
buckets: a small first one so communication starts early, then large ones. A
bucket's all-reduce starts asynchronously as soon as its last gradient lands
and buckets always start in the same order on every rank. A callback queued
on the autograd engine waits for all of them before ``backward()`` returns, so
the optimizer never sees an unsynchronised gradient.

Exactness. Rank r holds n_r samples of a global batch of N and its loss is a
mean over its own samples, so the global gradient is sum_r (n_r / N) g_r, not
the plain mean of the g_r (they differ whenever shards are uneven). Every
bucket carries two extra slots: n_r, whose all-reduced sum is N, and a
used-flag per parameter, so a parameter that got no gradient on any rank keeps
``grad = None`` as in a single process. Gradients are scaled while being
copied into the bucket by n_r / G, where G is the previous step's N (known
alike on all ranks), and after the all-reduce corrected by G / N only in the
rare step where N changed. After the all-reduce, ``p.grad`` is a view of the
bucket: no copy back.

Gradient accumulation (``no_sync``) needs each micro-batch k weighted by its
own share n_rk / N_k, which the final bucket cannot know. So from the first
forward inside ``no_sync`` until the next sync, every forward all-reduces its
sample count (one number, asynchronously, while the forward runs) and a
gradient hook scales each micro-batch's gradient by n_rk / N_k before autograd
accumulates it; the final buckets then just sum over ranks.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

from autodist.buckets import MB, Bucket, assign_buckets, average_
from autodist.runtime import log


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: a tensor, tuple, list or dict."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next(_tensors(obj), None)


class GradSync:
    """The gradient synchronisation state of one parallelized model."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, *, hooks: bool,
                 first_bucket_mb: float = 1.0, bucket_mb: float = 25.0, sync_buffers: bool = True) -> None:
        self.group = group
        self.hooks = hooks
        self.caps = (int(first_bucket_mb * MB), int(bucket_mb * MB))
        self.named = list(model.named_parameters())
        self.model = weakref.ref(model)
        self.sync_buffers = sync_buffers
        # what the buffers held at the last sync: only those changed since are averaged (BatchNorm updates
        # its running statistics without bumping the version counter, so contents are compared)
        self.buffer_snapshots = [b.detach().clone() for b in self._current_buffers()]
        self.enabled = True  # False inside no_sync()
        self.samples = 0  # samples seen by forward passes since the last sync
        self.forwards = 0
        self.previous_total = 1.0  # G: last step's global sample count, the same on every rank
        self.last_weight = 1.0  # this rank's weight at the last sync, for a backward with no new forward
        self.next_bucket = 0
        self.in_backward = False  # a backward through the model began and has not reached its end
        self.grads_arrived = False  # this backward brought gradients while syncing was enabled
        # gradient accumulation: per-micro-batch weights (see the module docstring)
        self.pending_counts: list[tuple[torch.Tensor, torch.Tensor, dist.Work]] = []  # (n_rk, N_k, work)
        self.micro_weight: torch.Tensor | None = None  # n_rk / N_k of the micro-batch being backpropagated
        self.prescale_handles: list[Any] = []
        self.param_handles: list[Any] = []
        self._build()
        self.handles = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
                        model.register_forward_hook(self._watch_output)]

    def _build(self) -> None:
        """Buckets and hooks for the parameters that are trainable now."""
        named = [(n, p) for n, p in self.named if p.requires_grad]
        low = [n for n, p in named if p.dtype in (torch.float16, torch.bfloat16)]
        if low:
            raise NotImplementedError(
                f"parameter {low[0]!r} is {dict(named)[low[0]].dtype}: autodist's exact gradient sync carries "
                f"sample counts inside the buckets and needs float32/float64 parameters; keep float32 weights "
                f"and compute in low precision with torch.autocast")
        self.trainable = tuple(p.requires_grad for _, p in self.named)
        self.names = {p: n for n, p in named}
        self.params = [p for _, p in named]
        self.buckets = [Bucket([self.params[i] for i in idx])
                        for idx in assign_buckets(self.params, *self.caps)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for handle in self.param_handles:
            handle.remove()
        self.param_handles = ([p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
                              if self.hooks else [])
        if self.prescale_handles:
            self._remove_prescale()
            self._install_prescale()

    # -- hooks ---------------------------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        if self.in_backward:
            self._discard_aborted_backward()
        if tuple(p.requires_grad for _, p in self.named) != self.trainable:
            # requires_grad changed since parallelize (unfreezing a layer, say): every rank must make the
            # same change, as it would to its optimizer, and the buckets follow
            if dist.get_rank() == 0:
                log.info("the set of trainable parameters changed: gradient buckets rebuilt")
            self._build()
        first = _first_tensor((args, kwargs))
        samples = first.shape[0] if first is not None and first.ndim > 0 else 1
        self.samples += samples
        self.forwards += 1
        if not self.enabled or self.prescale_handles:  # accumulating: this micro-batch needs its own weight
            self._install_prescale()
            device = self.params[0].device if self.params else torch.device("cpu")
            mine = torch.full((1,), float(samples), dtype=torch.float64, device=device)  # no host copy
            total = mine.clone()
            self.pending_counts.append((mine, total, dist.all_reduce(total, group=self.group, async_op=True)))

    def _watch_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Mark the moment a backward reaches the model's output, so that one that raises later is noticed."""
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._backward_began)

    def _backward_began(self, grad: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _discard_aborted_backward(self) -> None:
        """A backward that raised never reached its end-of-backward callback: drop what it left half done."""
        log.warning("the previous backward pass did not finish (it raised?): its half-done gradient sync is "
                    "discarded, and what it left in .grad is not a synchronized gradient: call "
                    "optimizer.zero_grad() before the next backward")
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # every rank started the same buckets before failing alike
            bucket.work = None
            bucket.ready.clear()
        for _, _, work in self.pending_counts:
            work.wait()
        self.pending_counts.clear()
        self._remove_prescale()
        self.next_bucket, self.samples, self.forwards = 0, 0, 0
        self.in_backward = self.grads_arrived = False

    def _install_prescale(self) -> None:
        if not self.prescale_handles:
            self.prescale_handles = [p.register_hook(self._prescale) for p in self.params]

    def _remove_prescale(self) -> None:
        for handle in self.prescale_handles:
            handle.remove()
        self.prescale_handles = []

    def _prescale(self, grad: torch.Tensor) -> torch.Tensor:
        """This micro-batch's gradient times n_rk / N_k, before autograd adds it to .grad."""
        if self.pending_counts:  # the first gradient of this backward: the counts of its forward(s)
            for _, _, work in self.pending_counts:
                work.wait()
            mine = sum(m for m, _, _ in self.pending_counts)
            total = sum(t for _, t, _ in self.pending_counts)
            self.micro_weight = (mine / total).reshape(())  # stays on the device: no host sync
            self.pending_counts.clear()
        if self.micro_weight is None:
            return grad
        weight = self.micro_weight.to(grad.dtype)
        # an empty micro-batch (NaN loss) has weight 0 and contributes nothing, not NaN
        return torch.where(weight > 0, grad * weight, torch.zeros_like(grad))

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._backward_began(p)  # a backward that did not pass through the model's output (a submodule's)
        self.grads_arrived = True
        bucket = self.bucket_of[p]
        if bucket.work is not None:
            raise RuntimeError(
                f"parameter {self.names[p]!r} received a second gradient after its bucket was already sent "
                f"in this backward pass (reentrant checkpointing does this); use "
                f"torch.utils.checkpoint with use_reentrant=False, or parallelize(..., sync='manual')")
        bucket.ready.add(id(p))
        while self.next_bucket < len(self.buckets) and \
                len(self.buckets[self.next_bucket].ready) == len(self.buckets[self.next_bucket].params):
            self._start(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _end_of_backward(self) -> None:
        # a backward that brought no gradient to sync (torch.autograd.grad for a gradient penalty, a
        # backward inside no_sync) leaves everything for the next one
        self.in_backward = False
        if self.grads_arrived:
            self.grads_arrived = False
            self.flush()

    # -- the sync ------------------------------------------------------------------------------
    def _weight(self) -> float:
        # No forward since the last sync: a second backward through the same graph keeps that step's
        # weights; none ever (the model called through a submodule, say): ranks weigh equally.
        return float(self.samples) if self.forwards else self.last_weight

    def _start(self, bucket: Bucket) -> None:
        count = self._weight()
        # accumulated micro-batches were weighted one by one: the buckets only sum
        scale = 1.0 if self.prescale_handles else count / self.previous_total
        bucket.start(count, scale, self.group)

    def flush(self) -> None:
        """Send what is not sent yet, wait for everything, and leave averaged gradients in ``.grad``."""
        for bucket in self.buckets[self.next_bucket:]:
            self._start(bucket)
        for bucket in self.buckets:
            bucket.work.wait()  # type: ignore[union-attr]
        total = self.buckets[0].total() if self.buckets else 0.0
        prescaled = bool(self.prescale_handles)
        correction = 1.0 if prescaled else self.previous_total / total if total > 0 else 0.0
        for bucket in self.buckets:
            bucket.unpack(correction)
        self._average_changed_buffers()
        if total > 0 and not prescaled:
            self.previous_total = total
        self.last_weight = self._weight()
        self._remove_prescale()
        self.micro_weight = None
        for _, _, work in self.pending_counts:  # forwards with no backward since: their counts are moot
            work.wait()
        self.pending_counts.clear()
        self.next_bucket, self.samples, self.forwards = 0, 0, 0

    def forget_buffers(self) -> None:
        """Count every buffer as changed at the next sync (its state before is unknown)."""
        self.buffer_snapshots = []

    def _current_buffers(self) -> list[torch.Tensor]:
        model = self.model()
        if not self.sync_buffers or model is None:
            return []
        return [b for b in model.buffers() if b.is_floating_point()]

    def _average_changed_buffers(self) -> None:
        """Buffers that some rank changed since the last sync (BatchNorm statistics) become their sample-weighted
        average; buffers no rank touched (masks, constants) stay exactly as they are."""
        buffers = self._current_buffers()  # model.to() may have replaced the buffer tensors
        if not buffers:
            return
        if [(b.shape, b.dtype, b.device) for b in buffers] != \
                [(s.shape, s.dtype, s.device) for s in self.buffer_snapshots]:
            self.buffer_snapshots = [torch.full_like(b, float("nan")) for b in buffers]  # all count as changed
        changed = torch.stack([(b != snapshot).any() for b, snapshot in zip(buffers, self.buffer_snapshots)])
        average_(buffers, self._weight(), self.group, changed)
        for b, snapshot in zip(buffers, self.buffer_snapshots):
            snapshot.copy_(b)

    def remove(self) -> None:
        for handle in [*self.handles, *self.param_handles]:
            handle.remove()
        self._remove_prescale()


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
    if model in _registry:
        raise RuntimeError("this model is already parallelized; call autodist.parallelize once per model")
    _registry[model] = registration


def is_parallelized(model: nn.Module) -> bool:
    return model in _registry


def registration_of(model: nn.Module) -> Registration | None:
    """The data-parallel layout parallelize gave ``model``; None if it was not parallelized."""
    return _registry.get(model)


def state_of(model: nn.Module) -> GradSync | None:
    registration = _registry.get(model)
    return registration.sync if registration is not None else None


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally: backward passes inside the block send no gradients.

    The next backward outside the block (or ``synchronize_model``) sends
    everything accumulated. Each micro-batch's gradient is weighted by this
    rank's share of that micro-batch, so the result equals one process
    accumulating the same global micro-batches, also when the shares differ
    (a short last batch). For those weights every forward from the first one
    inside the block until the sync all-reduces its sample count: one number,
    asynchronously, so every rank must run the same forwards.

    Example:
        >>> with autodist.no_sync(model):
        ...     loss_fn(model(x1), y1).backward()   # no gradient sent
        >>> loss_fn(model(x2), y2).backward()       # syncs the weighted sum of both

    Note:
        Exact with one forward per backward, the usual loop. A world of one, or
        a model that was not parallelized, makes this a no-op.
    """
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
    from autodist.runtime import init

    if what not in ("gradients", "parameters"):
        raise ValueError(f"what must be 'gradients' or 'parameters', got {what!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    world = init()
    if world.size == 1:
        return
    registration = _registry.get(model) or _unparallelized.get(model)
    if registration is not None and registration.dp == 1:
        return
    if what == "parameters":
        params = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            average_([p.data for p in params], 1.0, registration.dp_group if registration else None)
        return
    if registration is None:  # not parallelized: the user keeps it identical on all ranks
        # kept apart from _registry, so that parallelize(model) later is still allowed
        registration = Registration(world.size, world.rank, None, GradSync(model, None, hooks=False))
        registration.sync.forget_buffers()  # the forward before this call may have changed them already
        _unparallelized[model] = registration
    registration.sync.flush()  # type: ignore[union-attr]
