"""One server: a shard of the flat parameter vector, the optimizer that updates it, and the threads that serve it.

Each remote worker has a thread of its own here, blocked in a receive from that
worker: requests from different workers are served concurrently, and the shard
itself is changed under one lock (an update is a few vector operations). The
worker on this very rank calls :meth:`ShardServer.handle` directly.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch

from autodist.ps import wire
from autodist.ps.layout import Piece
from autodist.runtime.world import log


def _optimizer_class(module: str, qualname: str) -> type:
    """The worker's optimizer class, found among the modules this process has imported already (the server
    runs the same script, so the user's own optimizer module is there): nothing is imported on a peer's
    word, and only a ``torch.optim.Optimizer`` is accepted."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise wire.Refused(f"the optimizer {module}.{qualname} a worker asked for is not a torch.optim.Optimizer "
                           f"this server has imported: every rank must run the same script with the same optimizer")
    return obj


class ShardServer:
    """The state of one shard. ``workers``: the ranks that may send requests; ``staleness``: how many clocks a
    worker may run ahead of the slowest unfinished one (None: no bound); ``alpha``: EASGD's elastic force."""

    def __init__(self, pieces: list[Piece], numel: int, workers: list[int], staleness: int | None,
                 alpha: float | None) -> None:
        self.pieces, self.numel, self.staleness, self.alpha = pieces, numel, staleness, alpha
        self.cond = threading.Condition()
        self.flat: torch.Tensor | None = None  # set by the first INIT or LOAD
        self.grad = torch.zeros(numel)
        self.optimizer: torch.optim.Optimizer | None = None
        self.views: list[torch.Tensor] = []
        self.pending_state: dict[str, Any] | None = None
        self.version = 0  # updates applied
        self.clocks = {w: 0 for w in workers}  # workers still training -> their clock
        self.done: set[int] = set()
        self.lost: dict[int, str] = {}  # workers that vanished -> why

    # -- the state -----------------------------------------------------------------------------------
    def _start(self, flat: torch.Tensor, spec: dict[str, Any] | None) -> None:
        self.flat = flat.clone()
        self.views = [self.flat[p.offset:p.offset + p.stop - p.start] for p in self.pieces]
        for view, p in zip(self.views, self.pieces):
            view.grad = self.grad[p.offset:p.offset + p.stop - p.start]
        if spec is not None:
            self._build(spec)

    def _build(self, spec: dict[str, Any]) -> None:
        """The worker's optimizer, rebuilt here over this shard's pieces (same class, same hyperparameters)."""
        cls = _optimizer_class(*spec["class"])
        groups = []
        self.group_of: dict[int, int] = {}  # the user's group index -> this optimizer's
        for index, (hyper, params) in enumerate(spec["groups"]):
            mine = [v for v, p in zip(self.views, self.pieces) if p.param in params]
            if mine:
                self.group_of[index] = len(groups)
                groups.append({**hyper, "params": mine})
        if not groups:
            return
        try:
            self.optimizer = cls(groups, **spec["defaults"])
        except TypeError:
            self.optimizer = cls(groups)
        if self.pending_state is not None:
            self._load_optimizer(self.pending_state)
            self.pending_state = None

    def _set_hyper(self, hypers: list[dict[str, Any]]) -> None:
        if self.optimizer is None:
            return
        for index, hyper in enumerate(hypers):
            if index in self.group_of:
                self.optimizer.param_groups[self.group_of[index]].update(hyper)

    def _optimizer_state(self) -> dict[str, Any]:
        """Per-element state as flat vectors over the shard (zeros where a piece has none), scalars as they are."""
        if self.optimizer is None:
            return {"flat": {}, "scalars": {}}
        flat: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for view, p in zip(self.views, self.pieces):
            for key, value in self.optimizer.state.get(view, {}).items():
                if torch.is_tensor(value) and value.numel() == view.numel() and value.dim() > 0:
                    flat.setdefault(key, torch.zeros(self.numel))[p.offset:p.offset + view.numel()] = value
                else:
                    scalars[key] = value
        return {"flat": flat, "scalars": scalars}

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        grouped = {id(v) for g in self.optimizer.param_groups for v in g["params"]}
        for view, p in zip(self.views, self.pieces):
            if id(view) not in grouped or not state["flat"]:
                continue
            entry = {k: v[p.offset:p.offset + view.numel()].clone() for k, v in state["flat"].items()}
            entry.update({k: v.clone() if torch.is_tensor(v) else v for k, v in state["scalars"].items()})
            self.optimizer.state[view] = entry

    # -- requests ------------------------------------------------------------------------------------
    def handle(self, op: int, worker: int, clock: int, floats: torch.Tensor | None, blob: Any) -> wire.Message | None:
        """Serve one request of ``worker``; the reply, or None for a request that has none."""
        with self.cond:
            if op == wire.INIT:
                if self.flat is None:
                    self._start(floats, blob)  # type: ignore[arg-type]
                    self.cond.notify_all()
                elif self.optimizer is None and blob is not None:  # started by a LOAD: the optimizer comes now
                    self._build(blob)
                return None
            if op == wire.LOAD:
                if self.flat is None:
                    self.pending_state = blob["optimizer"]
                    self._start(floats, None)  # type: ignore[arg-type]
                    self.version = int(blob["version"])
                    self.cond.notify_all()
                return self._reply()
            if op == wire.DONE:
                self._finish(worker)
                return None
            if op == wire.BYE:  # the worker on this rank: nothing to close
                return None
            self._wait_started()
            if op == wire.PUSH:
                if blob is not None:
                    self._set_hyper(blob)
                self._apply_gradient(floats)  # type: ignore[arg-type]
                self._advance(worker, clock)
                return self._reply(self.flat.clone())  # type: ignore[union-attr]
            if op == wire.ELASTIC:
                elastic = (floats - self.flat).mul_(self.alpha)  # type: ignore[operator]
                self.flat.add_(elastic)  # type: ignore[union-attr]
                self.version += 1
                self._advance(worker, clock)
                return self._reply(elastic)
            if op == wire.PULL:
                return self._reply(self.flat.clone())  # type: ignore[union-attr]
            if op == wire.STATE:
                return self._reply(self.flat.clone(), {"optimizer": self._optimizer_state()})  # type: ignore[union-attr]
            if op == wire.FINAL:  # answered once every worker has finished or is gone
                while self.clocks:
                    self.cond.wait()
                return self._reply(self.flat.clone(), {"lost": dict(self.lost)})  # type: ignore[union-attr]
        raise ValueError(f"unknown parameter-server request {op} from rank {worker}")

    def _wait_started(self) -> None:
        while self.flat is None:  # another rank's INIT or LOAD is on its way (each rank sends one before anything)
            self.cond.wait()

    def _apply_gradient(self, grad: torch.Tensor) -> None:
        if self.optimizer is None:
            raise RuntimeError("a gradient reached a parameter server that has no optimizer: the workers' first "
                               "optimizer.step() describes it (class and hyperparameters), and none was sent")
        self.grad.copy_(grad)
        self.optimizer.step()
        self.version += 1

    def _advance(self, worker: int, clock: int) -> None:
        """Record ``worker``'s clock; with a staleness bound, hold it while it is too far ahead of the slowest."""
        if worker in self.clocks:
            self.clocks[worker] = clock
        self.cond.notify_all()
        if self.staleness is not None:
            while worker in self.clocks and clock - min(self.clocks.values()) > self.staleness:
                self.cond.wait()

    def _reply(self, floats: torch.Tensor | None = None, blob: Any = None) -> wire.Message:
        slowest = min(self.clocks.values()) if self.clocks else -1
        return wire.Message((self.version, slowest), floats, blob)

    def _finish(self, worker: int) -> None:
        self.clocks.pop(worker, None)
        self.done.add(worker)
        self.cond.notify_all()

    def lose(self, worker: int, why: str) -> None:
        """``worker`` vanished without finishing: go on without it."""
        with self.cond:
            if worker in self.done:
                return
            self.lost[worker] = why
            self._finish(worker)


class Serving:
    """The threads serving one shard's remote workers over ``group``."""

    def __init__(self, server: ShardServer, group: Any, workers: list[int], on_lost: Callable[[int, str], None]):
        self.server, self.group, self.on_lost = server, group, on_lost
        self.threads = [threading.Thread(target=self._serve, args=(w,), name=f"autodist-ps-serve-{w}", daemon=True)
                        for w in workers]
        for t in self.threads:
            t.start()

    def _serve(self, worker: int) -> None:
        try:
            while True:
                request = wire.recv(self.group, worker, wire.REQUEST_TAG)
                op, clock = request.head
                if op == wire.BYE:
                    return
                reply = self.server.handle(op, worker, clock, request.floats, request.blob)
                if reply is not None:
                    wire.wait(wire.send(self.group, worker, wire.REPLY_TAG, reply))
        except Exception as exc:  # noqa: BLE001 - the worker is gone (its socket closed): go on without it
            from autodist.faults.watchdog import is_peer_lost

            why = "its connection closed: the process died or was killed" if is_peer_lost(exc) else \
                (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            if worker in self.server.done:
                return
            if isinstance(exc, wire.Refused):
                log.error("parameter server: %s; worker rank %d is no longer served, training goes on with the "
                          "others", why, worker)
                why = f"its message was refused: {why}"
            else:
                log.warning("parameter server: worker rank %d is gone (%s); training goes on with the others",
                            worker, why)
            self.server.lose(worker, why)
            self.on_lost(worker, why)

    def join(self, timeout: float | None = None) -> None:
        for t in self.threads:
            t.join(timeout)
