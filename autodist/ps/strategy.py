"""What Downpour and EASGD share: the servers, the worker's side of the conversation, the step hooks, the end."""
from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp import step_hooks
from autodist.faults import watchdog
from autodist.ps import wire
from autodist.ps.layout import ShardLayout, flatten, unflatten_into
from autodist.ps.server import Serving, ShardServer
from autodist.runtime import ending
from autodist.runtime.world import log
from autodist.sync.base import Strategy, SyncContext
from autodist.train import checkpoint_file

_QUIET = datetime.timedelta(days=30)  # a worker may stay silent this long (evaluating, saving) without being lost


class ServerLost(RuntimeError):
    """A parameter server is gone: its shard was the only up-to-date copy, so the job cannot go on."""


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ParameterServer(Strategy):
    """Servers hold the flat parameter vector, cut by size over ranks ``0 .. servers-1`` (each also a worker);
    every rank is a worker. Subclasses say what a worker sends after its optimizer steps."""

    name = "parameter server"
    settles_dropped = True  # its servers serve the other workers until close(), the model dropped or not

    def __init__(self, *, servers: int = 1, staleness: int | None = None) -> None:
        super().__init__()
        self.servers = _positive("servers", servers)
        self.staleness = None if staleness is None else _positive("staleness", staleness, 0)
        self.steps = 0  # this worker's optimizer steps
        self.clock = 0  # this worker's exchanges with the servers (pushes, elastic moves)
        self.version = 0  # updates the servers had applied at the last reply
        self.max_lead = 0  # the most exchanges this worker was ever ahead of the slowest unfinished worker
        self.lost: dict[int, str] = {}  # workers lost (known at close; a server knows its own as they happen)
        self.started = self.closed = self.broken = False
        self.server: ShardServer | None = None
        self._mine: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()

    # -- setting up ----------------------------------------------------------------------------------
    def _start(self, model: nn.Module, ctx: SyncContext) -> None:
        world, self.me = dist.get_world_size(), dist.get_rank()
        if ctx.dp_ranks != tuple(range(world)):
            raise NotImplementedError(f"{type(self).__name__} serves data parallelism over every rank (mp=1); this "
                                      f"rank's data-parallel group is ranks {list(ctx.dp_ranks)}: use mp=1")
        if self.servers > world:
            raise ValueError(f"servers={self.servers} but the job has {world} ranks; servers live in ranks "
                             f"0..servers-1, so use servers <= {world}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.ids = {id(p) for p in self.params}
        self.layout = ShardLayout.split(tuple(p.numel() for p in self.params), tuple(range(self.servers)))
        self.group = dist.new_group(list(range(world)), backend="gloo", timeout=_QUIET)
        if self.me in self.layout.servers:
            index = self.layout.servers.index(self.me)
            lo, hi = self.layout.bounds[index]
            self.server = ShardServer(self.layout.pieces(index), hi - lo, list(range(world)), self.staleness,
                                      self._alpha(world))
            self.serving = Serving(self.server, self.group, [w for w in range(world) if w != self.me],
                                   self._worker_lost)
        step_hooks.listen(self)  # before_step / after_step around every optimizer.step()
        watchdog.on_data_end(self)
        return None

    def _alpha(self, world: int) -> float | None:
        return None

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.holds(optimizer):
            self._before_step(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.holds(optimizer):
            self._after_step(optimizer)

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self._mine.get(optimizer)
        if holds is None:
            holds = self._mine[optimizer] = any(id(p) in self.ids for g in optimizer.param_groups for p in g["params"])
        return holds and not self.closed

    def _worker_lost(self, rank: int, why: str) -> None:
        self.lost[rank] = why
        watchdog.rank_left(rank, f"a parameter-server worker, lost: {why}")

    # -- talking to the servers ----------------------------------------------------------------------
    def _slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[lo:hi] for lo, hi in self.layout.bounds]

    def _exchange(self, op: int, floats: list[torch.Tensor] | None = None, blob: Any = None) -> list[wire.Message]:
        """Send request ``op`` to every server (all at once), then collect their replies, in server order."""
        if self.broken:
            raise ServerLost("a parameter server was lost earlier (see the error above): the job cannot go on")
        pending, local, replies = [], None, [None] * len(self.layout.servers)
        rank = -1
        try:
            for i, rank in enumerate(self.layout.servers):
                message = wire.Message((op, self.clock), None if floats is None else floats[i], blob)
                if rank == self.me:
                    local = (i, message)
                    continue
                pending.append((i, rank, wire.send(self.group, rank, wire.REQUEST_TAG, message)))
                self._sent += 0 if message.floats is None else 4 * message.floats.numel()
            if local is not None:
                i, message = local
                replies[i] = self.server.handle(op, self.me, self.clock, message.floats, message.blob)  # type: ignore
            for i, rank, works in pending:
                wire.wait(works)
                if op in wire.REPLIES:
                    replies[i] = wire.recv(self.group, rank, wire.REPLY_TAG)
        except RuntimeError as exc:
            self.broken = True
            raise ServerLost(self._lost_server(rank, op, exc)) from None
        if op in wire.REPLIES:
            self.version = max(r.head[0] for r in replies)  # type: ignore[union-attr]
            slowest = [r.head[1] for r in replies if r.head[1] >= 0]  # type: ignore[union-attr]
            if slowest and op in (wire.PUSH, wire.ELASTIC):
                self.max_lead = max(self.max_lead, self.clock - min(slowest))
        return replies  # type: ignore[return-value]

    def _lost_server(self, rank: int, op: int, exc: BaseException) -> str:
        index = self.layout.servers.index(rank) if rank in self.layout.servers else 0
        lo, hi = self.layout.bounds[index]
        # not gloo's own words: the watchdog would take them for a collective's lost peer and tell another story
        why = "its connection closed: the process died or was killed" if watchdog.is_peer_lost(exc) else \
            (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return (f"the parameter server on rank {rank} (elements {lo}..{hi} of the model's {self.layout.total} "
                f"parameter elements) is gone ({why}) while rank {self.me} sent it a {wire.NAMES[op]} request: its "
                f"shard was the only up-to-date copy, so the job cannot go on. Restart from the last checkpoint "
                f"(ps.save and autodist.save write atomically, so the last one written is intact)")

    def _set_params(self, replies: list[wire.Message]) -> None:
        if any(r.floats is None for r in replies):
            return  # a server no worker ever started: the model keeps what it holds
        unflatten_into(torch.cat([r.floats for r in replies]), self.params)  # type: ignore[misc]

    def _send_init(self, spec: Any) -> None:
        self._exchange(wire.INIT, self._slices(flatten(self.params)), spec)
        self.started = True

    def pull(self) -> None:
        """Give the model the servers' current parameters (Downpour) or center variable (EASGD) now.

        Done for you when a pass over the loader ``parallelize`` returned ends, and by :meth:`close`.
        """
        if self.started and not self.closed:
            self._hand_back()
            self._set_params(self._exchange(wire.PULL))

    def data_ended(self) -> None:
        self.pull()

    def _hand_back(self) -> None:
        """Send what this worker still holds back (Downpour's accumulated gradient)."""

    # -- the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        """This worker is done: send what it holds, wait until every other worker is done (or gone), take the
        final parameters, and, on a server rank, serve the others until they leave. Every rank then holds the
        same final model. Called at exit if not before; idempotent.
        """
        if self.closed:
            return
        if self.started and not self.broken:
            self._hand_back()
        self.closed = True
        step_hooks.forget(self)
        ending.forget(self.settle)
        if self.broken:
            return
        self._exchange(wire.DONE)
        final = self._exchange(wire.FINAL)
        self._set_params(final)
        for reply in final:
            self.lost.update(reply.blob["lost"])
        self._exchange(wire.BYE)
        if self.server is not None:
            self.serving.join()
        dist.destroy_process_group(self.group)  # every rank is done with it: its connections and buffers go
        if self.lost and self.me == self.layout.servers[0]:
            gone = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.lost.items()))
            log.warning("parameter server: training finished with %d of %d workers; lost: %s",
                        dist.get_world_size() - len(self.lost), dist.get_world_size(), gone)

    def settle(self) -> None:
        """At the end of the script: :meth:`close`, if the script did not (a lost server is an error there)."""
        self.close()

    def remove(self) -> None:
        self.close()

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The servers' state: ``params`` (the flat parameter vector), the server optimizer's per-element state
        as flat vectors (``optimizer``), the update count (``version``); None before any worker stepped (the
        servers then hold nothing yet). Asks the servers; no collective."""
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed (its servers stopped): take its state before "
                               f"close(), e.g. with ps.save(path) or autodist.save at the end of a pass")
        replies = self._exchange(wire.STATE)
        if any(r.floats is None for r in replies):
            return None
        states = [r.blob["optimizer"] for r in replies]
        keys = sorted({k for s in states for k in s["flat"]})
        flat = {k: torch.cat([s["flat"].get(k, torch.zeros(r.floats.numel())) for s, r in zip(states, replies)])
                for k in keys}
        scalars: dict[str, Any] = {}
        for s in states:
            scalars.update(s["scalars"])
        return {"params": torch.cat([r.floats for r in replies]), "version": self.version,
                "optimizer": {"flat": flat, "scalars": scalars}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Start the servers from ``state`` (from :meth:`state_dict`); call it on every rank before the first
        step (the first to reach a server wins, and all read the same checkpoint). The model takes its params.
        None: nothing to load (the servers start from the model at the first step, as always)."""
        if state is None:
            return
        params = state["params"]
        if params.numel() != self.layout.total:
            raise ValueError(f"the saved parameter-server state holds {params.numel()} parameter elements, the "
                             f"model {self.layout.total}: load it into the model it was saved from")
        optimizer = state["optimizer"]
        for i, (lo, hi) in enumerate(self.layout.bounds):
            blob = {"version": state["version"], "optimizer": {
                "flat": {k: v[lo:hi].clone() for k, v in optimizer["flat"].items()}, "scalars": optimizer["scalars"]}}
            self._exchange_one(i, wire.LOAD, params[lo:hi].clone(), blob)
        unflatten_into(params, self.params)

    def _exchange_one(self, index: int, op: int, floats: torch.Tensor, blob: Any) -> None:
        rank = self.layout.servers[index]
        message = wire.Message((op, self.clock), floats, blob)
        if rank == self.me:
            self.server.handle(op, self.me, self.clock, floats, blob)  # type: ignore[union-attr]
            return
        try:
            wire.wait(wire.send(self.group, rank, wire.REQUEST_TAG, message))
            wire.recv(self.group, rank, wire.REPLY_TAG)
        except RuntimeError as exc:
            self.broken = True
            raise ServerLost(self._lost_server(rank, op, exc)) from None

    def save(self, path: str, **extra: Any) -> None:
        """Write a checkpoint of the servers' state from this rank alone (no collective: it works after a worker
        was lost, where ``autodist.save`` cannot). Its ``model`` entry is the servers' parameters under the
        model's names, so ``plain_model.load_state_dict(torch.load(path)["model"])`` works; the servers' state
        is the extra ``param_server``: ``ps.load_state_dict(autodist.load(path, model)["param_server"])``.
        """
        path = checkpoint_file.checked_path(path, writing=True)
        checkpoint_file.check_loadable(extra, "extra")
        state = self.state_dict()
        if state is None:
            raise RuntimeError("nothing to save yet: the parameter servers start at the first optimizer.step()")
        model = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        offset = 0
        for name, p in zip(self.names, self.params):
            model[name] = state["params"][offset:offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        extra = {**extra, "param_server": state}
        checkpoint_file.atomic_save(checkpoint_file.contents(model, None, extra, checkpoint_file.rng_state()), path)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError
