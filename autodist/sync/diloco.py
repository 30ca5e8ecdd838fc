"""DiLoCo: the user's optimizer steps locally; every H steps an outer optimizer steps on the averaged delta,
the whole model at once or (Streaming DiLoCo) one fragment at a time, its all-reduce overlapping inner steps."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autodist.layers.shard import Shard
from autodist.runtime.held import Held
from autodist.runtime.world import log
from autodist.sync.averaging import Done, Pending
from autodist.sync.base import SyncContext, tensor_names
from autodist.sync.periodic import Periodic, _positive

Fragment = tuple[list[torch.Tensor], list[torch.Tensor]]  # (parameters, floating-point buffers)

# The inner optimizers the outer step's defaults were measured over (benchmarks/bench_lowcomm.py, digits,
# 10 seeds; bench_lowcomm_lm.py): torch's SGD-like ones, and those that scale each coordinate's step by a
# running estimate of its gradient's size.
SGD_LIKE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.ASGD)
ADAPTIVE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
                                            "RMSprop", "SparseAdam", "Adafactor") if hasattr(torch.optim, name))
# outer_lr / (1 - momentum) = 1: once rounds agree the outer step goes as far as the replicas went, no farther;
# the momentum only smooths the direction over rounds. Within one point of exact sync on every seed, at
# every=16 and 64, over SGD (lr 0.05, momentum 0.9) and AdamW alike; the paper's values end at 7.8-24% over
# that SGD and up to 2.2 points under exact sync over AdamW (its language model: loss 1.139 against 1.042).
DEFAULT = (0.5, 0.5)
SAFE_REACH = 1.5  # over SGD, a reach outer_lr / (1 - momentum) the user set above this is warned about


def outer_step_for(optimizer: torch.optim.Optimizer) -> tuple[float, float, str]:
    """The outer step's ``(outer_lr, momentum)`` over the inner ``optimizer``, and what the optimizer is to
    the rule: ``"sgd"`` (torch's SGD and ASGD), ``"adaptive"`` (torch's Adam, AdamW, Adamax, NAdam, RAdam,
    Adagrad, Adadelta, RMSprop, SparseAdam, Adafactor and their subclasses), both measured to train within a
    point of exact sync with 0.5 and 0.5; or ``"unknown"`` (any other class: the same values, not measured).

    Example:
        >>> outer_step_for(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9))
        (0.5, 0.5, 'sgd')
    """
    if isinstance(optimizer, SGD_LIKE):
        return (*DEFAULT, "sgd")
    return (*DEFAULT, "adaptive" if isinstance(optimizer, ADAPTIVE) else "unknown")


def fragments_of(model: nn.Module, k: int) -> list[Fragment]:
    """The model cut into ``k`` runs of consecutive parameters of about the same number of elements (a
    parameter is never cut; each fragment has at least one); a float buffer goes with the parameter before it.
    Sizes are the dense model's (a model-parallel layer's parameter counts whole), so every rank of a
    model-parallel group cuts its shards alike, and the cut is the same at any mp degree.

    Example:
        >>> [len(params) for params, _ in fragments_of(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2)]
        [2, 2]
    """
    seen: set[int] = set()
    items: list[tuple[torch.Tensor, int | None]] = []  # (tensor, its dense size if a parameter)
    for module in model.modules():
        shards = getattr(module, "shards", None)  # a model-parallel layer: how each parameter is split
        dense = {name: math.prod(part.shape) for name, part in shards.items() if isinstance(part, Shard)} \
            if isinstance(shards, dict) else {}
        for name, t in module.named_parameters(recurse=False):
            if id(t) not in seen:
                seen.add(id(t))
                items.append((t, dense.get(name, t.numel())))
        for t in module.buffers(recurse=False):
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                items.append((t, None))
    starts, total = [], 0  # where each parameter starts among the parameters' elements
    for _, size in items:
        if size is not None:
            starts.append(total)
            total += size
    if len(starts) < k:
        raise ValueError(f"DiLoCo(fragments={k}): the model has {len(starts)} parameter tensors, fewer than the "
                         f"fragments; use at most fragments={len(starts)}")
    firsts = [0]  # the first parameter of each fragment: the first to start past j/k of the elements
    for j in range(1, k):
        first = next((i for i, at in enumerate(starts) if at * k >= j * total), len(starts))
        firsts.append(min(max(first, firsts[-1] + 1), len(starts) - (k - j)))
    parts: list[Fragment] = [([], []) for _ in range(k)]
    index, fragment = -1, 0
    for t, size in items:
        if size is not None:
            index += 1
            fragment = sum(1 for f in firsts[1:] if f <= index)
        parts[fragment][0 if size is not None else 1].append(t)
    return parts


class DiLoCo(Periodic):
    """Inner steps with the user's optimizer; every ``every`` steps the outer step.

    The replicas start each round from the same *outer* parameters theta. After
    ``every`` inner steps, the outer gradient is the samples-weighted average
    over replicas of theta - theta_r (how far each replica moved), and an outer
    SGD (``outer_lr``, ``momentum``, Nesterov by default) steps theta with it;
    every replica then continues from the new theta. Floating-point buffers
    (BatchNorm statistics) are averaged as in :class:`LocalSGD`.

    Streaming DiLoCo (``fragments=k``): the model is cut into k runs of
    consecutive modules of about equal size; fragment f has its outer step at
    local steps (f + 1) H / k, H + (f + 1) H / k, ..., so each fragment still
    meets every H steps but the traffic comes in k smaller, staggered parts.
    With ``overlap=tau`` a fragment's all-reduce starts tau steps before its
    outer step and runs while those tau inner steps compute; at the outer step
    the fragment becomes ``(1 - mix) * outer + mix * local`` (``mix`` weighs the
    local progress of those tau steps, which the outer gradient did not see).

    Args:
        every: inner optimizer steps per outer step of each fragment (H).
        outer_lr: the outer SGD's learning rate; None: chosen from the inner optimizer (see the note).
        momentum: the outer SGD's momentum (0 for none); None: chosen from the inner optimizer.
        nesterov: Nesterov momentum (ignored when ``momentum`` is 0).
        warmup: optimizer steps of exact sync before the inner steps begin.
        fragments: how many fragments take their outer steps at staggered steps (must divide ``every``).
        overlap: inner steps a fragment's all-reduce runs behind (0 to H/k - 1).
        mix: with ``overlap``, the weight of the local parameters in the fragment after its outer step.

    What it promises instead of exactness:
        * with ``overlap=0``, right after a fragment's outer step every replica holds the very same
          parameters in that fragment (the outer ones);
        * with ``outer_lr=1`` and ``momentum=0`` it is :class:`LocalSGD` (the outer step lands on the
          weighted average of the replicas); ``fragments=1`` is plain DiLoCo;
        * one model's worth of bytes per ``every`` steps (``bytes_sent``), in ``fragments`` parts.
        ``autodist.save`` / ``load`` / ``resume`` keep the outer state (theta, its momentum, the step count,
        the chosen ``outer_lr`` and ``momentum``), dense: a checkpoint taken at one mp degree resumes at
        another.

    Example:
        >>> diloco = autodist.DiLoCo(every=64)
        >>> model, loader = autodist.parallelize(model, loader, sync=diloco)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # the inner optimizer
        >>> for x, y in loader:
        ...     optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        >>> diloco.outer_lr, diloco.momentum   # chosen at the first step, for the inner SGD
        (0.5, 0.5)

    Note:
        ``outer_lr`` and ``momentum`` left unset are chosen at the first optimizer step, from the inner
        optimizer (:func:`outer_step_for`), and logged on rank 0. Once rounds point the same way, the outer
        step moves the weights up to ``outer_lr / (1 - momentum)`` times as far as the replicas moved. The
        DiLoCo paper's 0.7 and Nesterov 0.9 (7x), tuned over AdamW for language models hundreds of steps
        apart, diverge over an SGD whose steps are already as long as its stability allows, and fall up to
        2 points short of exact sync over AdamW on the benchmarks here; 0.5 and 0.5 (1x: the replicas' own
        reach, the momentum smoothing the direction) train within a point of exact sync over both, so they are
        chosen over torch's SGD and adaptive optimizers, and, with a warning, over any other class.
        ``DiLoCo(outer_lr=0.7, momentum=0.9)`` is the paper's. Values you pass win, over a checkpoint's too;
        over SGD a reach you set above 1.5 is warned about. As for :class:`LocalSGD`: one optimizer per model,
        the same number of steps on every rank.
    """

    name = "DiLoCo"
    mirrors = ("outer_params", "outer_momentum", "pending")

    def __init__(self, *, every: int = 64, outer_lr: float | None = None, momentum: float | None = None,
                 nesterov: bool = True, warmup: int = 0, fragments: int = 1, overlap: int = 0,
                 mix: float = 0.5) -> None:
        super().__init__(every, warmup)
        if outer_lr is not None and not (isinstance(outer_lr, (int, float)) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number (or None: chosen from the inner optimizer), "
                             f"got {outer_lr!r}")
        if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"momentum must be a number in [0, 1) (or None: chosen from the inner optimizer), "
                             f"got {momentum!r}")
        self.fragments = _positive("fragments", fragments)
        if every % fragments:
            raise ValueError(f"fragments ({fragments}) must divide every ({every}): each fragment has its outer "
                             f"step every {every} steps, one fragment every {every}/{fragments} steps")
        self.overlap = _positive("overlap", overlap, 0)
        if overlap >= every // fragments:
            raise ValueError(f"overlap must be below every/fragments = {every // fragments} (a fragment's "
                             f"all-reduce must finish before the next fragment's starts), got {overlap}")
        if not (isinstance(mix, (int, float)) and 0 <= mix <= 1):
            raise ValueError(f"mix must be a number in [0, 1], got {mix!r}")
        # the user's values (None: chosen from the inner optimizer at its first step), and those in use
        self.asked = (None if outer_lr is None else float(outer_lr), None if momentum is None else float(momentum))
        self.outer_lr, self.momentum = self.asked
        self.chosen_for: str | None = None  # the inner optimizer's class the unset values were chosen for
        self.nesterov, self.mix = bool(nesterov), float(mix)
        self.offsets = [(f + 1) * every // fragments for f in range(fragments)]  # each fragment's step in a round
        self._pending: dict[int, Pending] = {}
        self._samples = 0.0  # samples counted since the local phase began, and at each fragment's last launch
        self._launched_at = [0.0] * fragments
        self._error: str | None = None
        self._seen = False  # the inner optimizer: the unset values chosen from it, a risky set one warned about

    def _start(self, model: nn.Module, ctx: SyncContext) -> Any:
        exact = super()._start(model, ctx)
        self.parts = fragments_of(model, self.fragments)
        self.names = [(tensor_names(model, params), tensor_names(model, buffers)) for params, buffers in self.parts]
        self.outer_params = [[p.detach().clone() for p in params] for params, _ in self.parts]
        self.outer = torch.optim.SGD([p for ps in self.outer_params for p in ps], lr=0.0)
        self._set_outer()
        return exact

    def _set_outer(self) -> None:
        """The outer SGD takes the values in use (unset ones: 0, until chosen at the first step)."""
        group = self.outer.param_groups[0]
        group["lr"], group["momentum"] = self.outer_lr or 0.0, self.momentum or 0.0
        group["nesterov"] = self.nesterov and bool(self.momentum)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._seen:
            self._seen = True
            self._choose(optimizer)
            self._warn_about(optimizer)
        super()._before_step(optimizer)

    def _begin_local(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for outers, (params, _) in zip(self.outer_params, self.parts):
                for outer, p in zip(outers, params):
                    outer.copy_(p)

    def _choose(self, optimizer: torch.optim.Optimizer) -> None:
        """Unset ``outer_lr`` and ``momentum`` from the inner optimizer's class (:func:`outer_step_for`)."""
        if self.outer_lr is not None and self.momentum is not None:
            return
        lr, momentum, rule = outer_step_for(optimizer)
        self.outer_lr = lr if self.outer_lr is None else self.outer_lr
        self.momentum = momentum if self.momentum is None else self.momentum
        self.chosen_for = type(optimizer).__name__
        self._set_outer()
        if self._comm is None or self._comm.rank != 0:
            return
        chosen = " and ".join(name for name, asked in zip(("outer_lr", "momentum"), self.asked) if asked is None)
        if rule == "unknown":
            log.warning("%r: %s chosen as 0.5 and 0.5, measured over torch's SGD and adaptive optimizers (%s), not "
                        "over %s; set them with autodist.DiLoCo(outer_lr=..., momentum=...) if it does not train",
                        self, chosen, ", ".join(c.__name__ for c in (*SGD_LIKE, *ADAPTIVE)), self.chosen_for)
            return
        log.info("%r: %s chosen for the inner %s (0.5 and 0.5: outer_lr / (1 - momentum) = 1, the outer step goes as "
                 "far as the replicas went; the DiLoCo paper's 0.7 and 0.9 go 7x as far); set them with "
                 "autodist.DiLoCo(outer_lr=..., momentum=...)", self, chosen, self.chosen_for)

    def _warn_about(self, optimizer: torch.optim.Optimizer) -> None:
        """Over an inner SGD, a reach the user set beyond what trains there (the chosen values do not warn)."""
        assert self.outer_lr is not None and self.momentum is not None
        reach = self.outer_lr / (1 - self.momentum)
        if self.asked == (None, None) or reach <= SAFE_REACH or not isinstance(optimizer, SGD_LIKE) \
                or self._comm is None or self._comm.rank != 0:
            return
        lr = optimizer.param_groups[0].get("lr")
        log.warning("%r over an inner SGD (lr %s): its outer step moves the weights up to outer_lr/(1 - momentum) "
                    "= %.1fx as far as the replicas moved in a round. Over SGD near its stability limit that "
                    "diverges (digits, SGD lr 0.05 momentum 0.9, outer_lr=0.7, momentum=0.9: 7.8%% accuracy). If "
                    "the loss rises after the first outer steps, leave outer_lr and momentum unset (over SGD they "
                    "are 0.5 and 0.5: 1x), use a smaller inner lr, an inner AdamW, or autodist.LocalSGD",
                    self, lr, reach)

    def _local_step(self, n: int) -> None:
        phase = n % self.every
        for f, offset in enumerate(self.offsets):
            if phase == (offset - self.overlap) % self.every:
                self._launch(f)
            if phase == offset % self.every:
                self._land(f)

    def _launch(self, f: int) -> None:
        """Start fragment f's average of (outer - local) and of its float buffers."""
        self._samples += self.tally.count
        self._error = self._error or self.tally.error
        self.tally.reset()
        weight, self._launched_at[f] = self._samples - self._launched_at[f], self._samples
        params, buffers = self.parts[f]
        with torch.no_grad():
            deltas = [outer - p.detach() for outer, p in zip(self.outer_params[f], params)]
        self._pending[f] = self._sending(lambda: self.averager.start(deltas + buffers, weight,  # type: ignore[union-attr]
                                                                     self._error))
        self.in_flight.add(self._pending[f].handles)

    def _land(self, f: int) -> None:
        """Fragment f's outer step on the averaged delta; the replicas continue from it."""
        if f not in self._pending:  # loaded from a checkpoint that holds no average of f under way
            self._launch(f)
        averaged = self._pending.pop(f).wait()
        self.in_flight.waited()
        params, buffers = self.parts[f]
        outers = self.outer_params[f]
        mix = self.mix if self.overlap else 0.0
        with torch.no_grad():
            for outer, delta in zip(outers, averaged):
                outer.grad = delta
            self.outer.step()  # the other fragments have no .grad: SGD leaves them (and their momentum) alone
            for outer, p in zip(outers, params):
                outer.grad = None
                if mix:
                    p.mul_(mix).add_(outer, alpha=1 - mix)
                else:
                    p.copy_(outer)
            for b, avg in zip(buffers, averaged[len(params):]):
                b.copy_(avg)
        self.syncs += 1

    def held(self) -> Held:
        """The outer parameters and their momentum (the outer optimizer's), the averages under way."""
        held = Held()
        outers = [t for ts in self.outer_params for t in ts]
        held.add("optimizer state", *outers, *(v for t in outers for v in self.outer.state.get(t, {}).values()
                                               if torch.is_tensor(v)))
        held.add("autodist buffers", *(t for average in self._pending.values()
                                       for t in [*getattr(average, "flats", ()), *(average._result or ())]))
        return held

    def settle(self) -> None:
        """At the end of the script: the averages under way are waited for on every rank and not applied
        (every fragment always has one under way in streamed DiLoCo; ``autodist.save`` keeps them)."""
        for average in self._pending.values():
            average.abandon()
        self.in_flight.waited()
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        """The outer parameters and their momentum, and the averages of fragments under way (waited for: every
        rank holds the same result), each keyed by the model's tensor names; the outer SGD's hyperparameters
        (``chosen``: whether its lr and momentum are the run's, False only before the first step chose them),
        the step and sample counts."""
        names = [name for params, _ in self.names for name in params]
        outers = [t for ts in self.outer_params for t in ts]
        momentum = {name: self.outer.state[t]["momentum_buffer"].clone() for name, t in zip(names, outers)
                    if self.outer.state.get(t, {}).get("momentum_buffer") is not None}
        pending: dict[str, torch.Tensor] = {}
        for f, average in sorted(self._pending.items()):
            params, buffers = self.names[f]
            pending.update({name: t.clone() for name, t in zip(params + buffers, average.wait())})
        return {**super().state_dict(), "outer_params": {name: t.clone() for name, t in zip(names, outers)},
                "outer_momentum": momentum, "outer": {k: v for k, v in self.outer.param_groups[0].items()
                                                      if k != "params"},
                "chosen": self.outer_lr is not None and self.momentum is not None, "chosen_for": self.chosen_for,
                "samples": self._samples, "launched_at": list(self._launched_at), "pending": pending,
                "pending_fragments": sorted(self._pending)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        super().load_state_dict(state)
        self._pending, self._error = {}, None
        if state is None:  # the outer parameters are taken from the model at the next step; no momentum yet
            self._samples, self._launched_at = 0.0, [0.0] * self.fragments
            self.outer.state.clear()
            return
        names = [name for params, _ in self.names for name in params]
        outers = [t for ts in self.outer_params for t in ts]
        saved = state["outer_params"]
        missing, unexpected = sorted(set(names) - saved.keys()), sorted(saved.keys() - set(names))
        wrong = [f"{n!r}: saved {tuple(saved[n].shape)}, here {tuple(t.shape)}" for n, t in zip(names, outers)
                 if n in saved and saved[n].shape != t.shape]
        if missing or unexpected or wrong:
            raise ValueError(f"the saved DiLoCo state does not fit the model: outer parameters missing "
                             f"{missing[:4]}, unexpected {unexpected[:4]}, of other shapes {wrong[:4]}; load it into "
                             f"the model it was saved from")
        with torch.no_grad():
            for name, outer in zip(names, outers):
                outer.copy_(saved[name])
        momentum = state["outer_momentum"]
        self.outer.load_state_dict({"state": {i: {"momentum_buffer": momentum[n]} for i, n in enumerate(names)
                                              if n in momentum},
                                    "param_groups": [{**state["outer"], "params": list(range(len(outers)))}]})
        self._resume_outer(state)
        self._samples, self._launched_at = float(state["samples"]), [float(x) for x in state["launched_at"]]
        self._pending = self._restored(state["pending"], state["pending_fragments"])
        self._fresh = False

    def _resume_outer(self, state: dict[str, Any]) -> None:
        """The values the saved run used, for those left unset here (values set here win); a checkpoint saved
        before its run's first step chose nothing: they are chosen at the next step."""
        if state.get("chosen", True):  # a checkpoint from before the choice existed holds the values it used
            saved = (float(state["outer"]["lr"]), float(state["outer"]["momentum"]))
            if None in self.asked:
                self.chosen_for = state.get("chosen_for")
            self.outer_lr, self.momentum = (mine if mine is not None else theirs
                                            for mine, theirs in zip(self.asked, saved))
        self._set_outer()

    def _restored(self, pending: dict[str, torch.Tensor], fragments: list[int]) -> dict[int, Pending]:
        """The saved averages under way, per fragment; a fragment the checkpoint holds only in part (its model
        was cut otherwise: another mp degree) takes its average again at its outer step."""
        restored: dict[int, Pending] = {}
        for f in fragments:
            names = self.names[f][0] + self.names[f][1]
            tensors = self.parts[f][0] + self.parts[f][1]
            if all(name in pending for name in names):
                restored[int(f)] = Done([pending[n].to(t.device, t.dtype) for n, t in zip(names, tensors)])
            elif self._comm is not None and self._comm.rank == 0:
                log.warning("the checkpoint holds the average under way of fragment %d of %r for other tensors than "
                            "this model's (its model was cut otherwise, e.g. at another mp degree): the fragment's "
                            "average is taken again at its outer step, without the overlap", f, self)
        return restored

    def __repr__(self) -> str:
        streamed = f", fragments={self.fragments}, overlap={self.overlap}, mix={self.mix}" \
            if self.fragments > 1 or self.overlap else ""
        return (f"DiLoCo(every={self.every}, outer_lr={self.outer_lr}, momentum={self.momentum}, "
                f"nesterov={self.nesterov}, warmup={self.warmup}{streamed})")
