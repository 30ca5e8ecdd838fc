"""Gossip (MALT-2's sparse-reduce, SGP): each round a replica averages with a few peers, without waiting."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autodist.runtime import comm, ending
from autodist.runtime.held import Held
from autodist.runtime.world import log
from autodist.sync.averaging import float_state
from autodist.sync.base import Strategy, SyncContext
from autodist.sync.periodic import _positive
from autodist.sync.stepping import StepWatch


def offsets(round_: int, size: int, peers: int) -> list[int]:
    """The exponential graph of round ``round_``: this round's ``peers`` offsets among 1, 2, 4, ... < size.

    Example:
        >>> [offsets(t, 8, 1) for t in range(4)]
        [[1], [2], [4], [1]]
    """
    powers = [2 ** k for k in range(max(1, math.ceil(math.log2(size))))]
    chosen = [powers[(round_ * peers + j) % len(powers)] % size for j in range(peers)]
    return list(dict.fromkeys(o for o in chosen if o))


class Gossip(Strategy):
    """Every ``every`` optimizer steps, a replica sends its parameters (and float buffers) to ``peers``
    replicas and receives from as many, on an exponential graph that changes every round: replica i
    sends to i + 2^k and hears from i - 2^k (mod P), k cycling through 0 .. ceil(log2 P) - 1, so over
    log2 P rounds each replica hears from O(log P) others. The exchange is non-blocking: it runs while
    the next ``every`` steps compute, and is folded in at the next round (the NOTIFY_ACK idea: nobody
    waits for the slowest replica; only a peer's message of the round before is awaited).

    Folding in keeps the replica's own progress since it sent: theta_i += (sum_j s_j - k s_i) / (1 + k),
    s being the parameters sent, k the peers.

    Args:
        every: optimizer steps per gossip round.
        peers: peers per round (each one more message of one model per round).

    What it promises instead of exactness:
        * the average of the replicas' parameters moves only by the replicas' own steps: gossip itself
          never changes it (the mixing is doubly stochastic);
        * the replicas contract towards their average: with no learning, ``peers=1`` and P a power of two,
          every replica holds the initial average after log2 P rounds (then ``flush()``); for other P the
          distance shrinks geometrically;
        * each rank sends ``peers`` models per round and never joins a collective.
        Replicas never hold the same parameters exactly: end with ``flush()`` and then
        ``autodist.synchronize_model(model, what="parameters")`` for one model. ``autodist.save`` folds
        the exchange under way in and keeps the round count; a restart continues every replica from
        rank 0's model (what the checkpoint holds), on the graph of the round it stopped at.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, sync=autodist.Gossip())
        >>> ...                                  # the ordinary loop
        >>> gossip.flush(); autodist.synchronize_model(model, what="parameters")
    """

    name = "gossip"

    def __init__(self, *, every: int = 1, peers: int = 1) -> None:
        super().__init__()
        self.every = _positive("every", every)
        self.peers = _positive("peers", peers)
        self.steps = 0
        self.rounds = 0
        self._pending: list[tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = []  # handles, sent, received

    def _start(self, model: nn.Module, ctx: SyncContext) -> None:
        self.tensors = float_state(model)
        self.by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in self.tensors:
            self.by_kind.setdefault((t.dtype, t.device), []).append(t)
        self.watch = StepWatch(model, self._after_step)
        if ctx.dp_rank == 0:  # said once, by the exit's settle or, the model dropped, by the exit's wait
            self.in_flight.note = (f"{self!r}: the script ended with its last exchange under way; autodist waited "
                                   f"for it at exit (end with gossip.flush() and autodist.synchronize_model(model, "
                                   f"what='parameters') for one final model)")
        return None

    def _after_step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.round()

    def round(self) -> None:
        """Fold in the last round's messages, then start this round's exchange (called after every
        ``every``-th step; call it yourself only with ``every`` set higher than the steps you take)."""
        self.flush()
        group = self._comm
        assert group is not None
        before = group.bytes_sent
        me, size = group.rank, group.size
        sent = [_flatten_dense_tensors([t.detach() for t in ts]) for ts in self.by_kind.values()]
        for offset in offsets(self.rounds, size, self.peers):
            handles, received = [], []
            for flat in sent:
                received.append(torch.empty_like(flat))
                handles.append(comm.send(flat, dst=(me + offset) % size, comm=group, async_op=True))
                handles.append(comm.recv(received[-1], src=(me - offset) % size, comm=group, async_op=True))
            self._pending.append((handles, sent, received))
            self.in_flight.add(handles)
        self._counted(before)
        self.rounds += 1

    def flush(self) -> None:
        """Wait for the exchange under way and fold it in (a no-op when none is)."""
        if not self._pending:
            return
        k = len(self._pending)
        sums: dict[int, torch.Tensor] = {}
        for handles, sent, received in self._pending:
            for h in handles:
                h.wait()
            for i, (s, r) in enumerate(zip(sent, received)):
                sums[i] = sums[i] + (r - s) if i in sums else r - s
        self._pending = []
        self.in_flight.waited()
        with torch.no_grad():
            for i, ts in enumerate(self.by_kind.values()):
                for t, step in zip(ts, _unflatten_dense_tensors(sums[i] / (1 + k), ts)):
                    t.add_(step)

    def held(self) -> Held:
        """The models sent and received in the exchange under way."""
        held = Held()
        held.add("autodist buffers", *(t for _, sent, received in self._pending for t in sent + received))
        return held

    def settle(self) -> None:
        """The script ended without ``flush()``: wait for the last exchange, as ``flush()`` would."""
        if self._pending:
            self.flush()
            if self.in_flight.note:
                log.warning("%s", self.in_flight.note)

    def state_dict(self) -> dict[str, Any]:
        """The step and round counts (the graph's phase); the exchange under way is folded in first."""
        self.flush()
        return {"steps": self.steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._pending = []
        if state is not None:
            self.steps, self.rounds = int(state["steps"]), int(state["rounds"])

    def remove(self) -> None:
        self.flush()
        self.watch.remove()
        ending.forget(self.settle)

    def __repr__(self) -> str:
        return f"Gossip(every={self.every}, peers={self.peers})"
