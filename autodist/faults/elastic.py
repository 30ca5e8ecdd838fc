"""Elastic data parallelism: the ranks left after one is lost go on with the same training, without a restart.

Under ``autodist run --elastic`` (``AUTODIST_ELASTIC=1``) plain data parallelism sums its gradients over a process
group of this module's, one per *generation* (the ranks alive together), made with the group's timeout at
``AUTODIST_TIMEOUT``. The launcher hosts the rendezvous store, so the store outlives every rank, and it appends
each rank that ends badly to the store's ``gone`` list at once.

Each sync ends with an agreement in the store, so that every rank applies the same steps:

* a rank whose all-reduce completed adds one to the sync's count; the rank that completes the count writes
  ``commit``;
* a rank whose all-reduce failed (a peer's connection reset; the group's timeout for a peer frozen or cut
  off) writes ``abort``; so does a rank that has waited ``AUTODIST_TIMEOUT`` for the outcome (a member ended
  between its all-reduce and its count);
* the first word written stands (compare-and-set): every rank acts on the same one.

After an abort nobody applies the step: the ranks meet in the next generation. Each appends itself to its
arrival list; the list closes when every rank of the old generation has arrived or is gone; a missing rank whose
heartbeat (:func:`beat`) goes on, busy alone in its own code, is waited for up to ``AUTODIST_BUSY_TIMEOUT``, a
silent one ``AUTODIST_TIMEOUT``. A rank whose all-reduce waits for a peer that left it does not
wait for gloo's timeout: it watches the sync's outcome key while it waits (:meth:`Elastic.wait_for`), and
leaves once another rank wrote ``abort``, and the first rank to close it writes the members (again
compare-and-set). The members make a new group among themselves (``new_group`` with local
synchronisation: the default group, which holds the lost rank, is not used again) and number themselves
0..n-1 in their old order. A rank that arrives after the list closed is not a member: it raises, naming why.

Example:
    >>> state = start(world, launch, timeout=60.0)   # every rank, in parallelize, under autodist run --elastic
    >>> if not state.agree(completed=True):         # each sync: False if no rank applies it
    ...     state.regroup(error)                     # this rank's all-reduce error, or None
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from autodist.runtime import ending
from autodist.runtime.environment import Launch, rendezvous_address
from autodist.runtime.world import World, log

PREFIX = "autodist/elastic"  # the launcher writes gone ranks under it (see autodist.cli.keep_going)
GONE = "gone"  # "3,5," the ranks the launcher saw end badly


class GaveUp(RuntimeError):
    """Another rank wrote ``abort`` for this sync while this rank's all-reduce still waited."""


class LeftOut(RuntimeError):
    """This rank arrived at a generation after its members were fixed: the others went on without it."""


class Elastic:
    """This rank's place in the ranks that are alive together: the generation, its members (ranks of the
    launch, in order), the group they sum over, and the count of syncs agreed on in it."""

    def __init__(self, store: Any, me: int, size: int, timeout: float, busy: float) -> None:
        self.store, self.me, self.timeout, self.busy = store, me, timeout, busy
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(size))
        self.syncs = 0  # the syncs of this generation agreed on (committed or aborted)
        self.committed = 0  # every sync committed since the start, in every generation
        self.group = self._group()

    @property
    def rank(self) -> int:
        """This rank's index among the members."""
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)

    def _group(self) -> dist.ProcessGroup:
        return dist.new_group(list(self.members), use_local_synchronization=True,
                              timeout=timedelta(seconds=self.timeout))

    def gone(self) -> set[int]:
        """The ranks the launcher saw end badly so far."""
        text = self.store.get(GONE).decode() if self.store.check([GONE]) else ""
        return {int(r) for r in text.split(",") if r}

    # -- each sync -------------------------------------------------------------------------------
    def agree(self, completed: bool) -> bool:
        """Whether every rank of the generation applies this sync (each rank calls it once per sync, with
        whether its own all-reduce ``completed``); the same answer on every rank that gets one."""
        self.syncs += 1
        key = f"{self.generation}/sync/{self.syncs}"
        if completed:
            if self.store.add(f"{key}/done", 1) == self.size:
                self.store.compare_set(f"{key}/outcome", "", "commit")
                if self.syncs > 1:  # every rank is past the previous sync's outcome: its keys can go
                    before = f"{self.generation}/sync/{self.syncs - 1}"
                    self.store.delete_key(f"{before}/done")
                    self.store.delete_key(f"{before}/outcome")
        else:
            self.store.compare_set(f"{key}/outcome", "", "abort")
        outcome = self._outcome(f"{key}/outcome")
        self.committed += outcome == "commit"
        return outcome == "commit"

    def wait_for(self, works: list[Any]) -> None:
        """Return once every work (this sync's all-reduces) has completed, well or not; raise if another rank
        wrote ``abort`` for this sync first: a peer it waits for may wait for a rank that left (gloo's abort
        does not end a wait already under way, and its timeout is ``AUTODIST_TIMEOUT``)."""
        key = f"{self.generation}/sync/{self.syncs + 1}/outcome"  # only an abort is written before this rank counts
        pause, looked = 0.0001, time.monotonic()
        while not all(work is None or work.is_completed() for work in works):
            now = time.monotonic()
            if now - looked > 0.05:
                looked = now
                if self.store.check([key]):
                    raise GaveUp("another rank's gradient sync failed")
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _outcome(self, key: str) -> str:
        """The sync's word, once written (the store wakes the wait: no polling); ``abort`` written here if it
        is not written within ``AUTODIST_TIMEOUT``: a member ended between its all-reduce and its count."""
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except dist.DistStoreError:
            return self.store.compare_set(key, "", "abort").decode()
        return self.store.get(key).decode()

    # -- a new generation --------------------------------------------------------------------------
    def regroup(self, failed: BaseException | None) -> None:
        """Meet the ranks left in the next generation and sum over them from now on (see the module
        docstring); ``failed``: this rank's collective's error (None: another rank's failed). Raises
        :class:`LeftOut` if they went on without this rank."""
        began = time.monotonic()
        _abort(self.group)  # this rank is done with it (its peers' waits end by wait_for: gloo's abort does not)
        nxt = self.generation + 1
        arrived, members = f"{nxt}/arrived", f"{nxt}/members"
        self.store.append(arrived, f"{self.me},")
        alive = Alive(self.store, self.timeout, self.busy)
        while not self.store.check([members]):
            here = {int(r) for r in self.store.get(arrived).decode().split(",") if r}
            gone = self.gone()
            missing = [r for r in self.members if r not in here and r not in gone]
            if not missing or alive.given_up(missing, nxt, speaks=self.me == min(here)):
                chosen = ",".join(str(r) for r in self.members if r in here and r not in gone)
                self.store.compare_set(members, "", chosen)
                break
            time.sleep(0.01)
        fixed = tuple(int(r) for r in self.store.get(members).decode().split(",") if r)
        if self.me not in fixed:
            raise LeftOut(f"rank {self.me} reached generation {nxt} of the elastic job after the other ranks had "
                          f"gone on without it (ranks {list(fixed)}): its heartbeat had stopped for "
                          f"AUTODIST_TIMEOUT={self.timeout:g} s, or it was busy longer than AUTODIST_BUSY_TIMEOUT="
                          f"{self.busy:g} s; the job goes on without this rank")
        lost = [r for r in self.members if r not in fixed]
        self.generation, self.members, self.syncs = nxt, fixed, 0
        try:
            self.group = self._group()
        except Exception as exc:  # noqa: BLE001 - a member was lost while the group formed: meet again
            self.regroup(exc)
            return
        if self.rank == 0 and not lost:
            log.warning("elastic: the gradient sync was given up (%s) while a rank was busy in its own code past "
                        "AUTODIST_TIMEOUT; the step in flight was abandoned (no rank applied it) and %s go on as "
                        "generation %d, the same ranks (%.2f s to regroup)", _reason(failed), _ranks(fixed), nxt,
                        time.monotonic() - began)
        elif self.rank == 0:
            log.warning("elastic: lost %s (%s); the step in flight was abandoned (no rank applied it), and %s %s "
                        "on as generation %d, each global batch split over %s: the same training (%.2f s to "
                        "regroup)", _ranks(lost), _reason(failed), _ranks(fixed), "goes" if len(fixed) == 1 else "go",
                        nxt, "it" if len(fixed) == 1 else "them", time.monotonic() - began)


class Alive:
    """Which missing members of a regroup are still waited for: a rank whose heartbeat goes on (alive in its own
    code: evaluating or saving alone) up to ``AUTODIST_BUSY_TIMEOUT``, a silent one up to ``AUTODIST_TIMEOUT``."""

    def __init__(self, store: Any, timeout: float, busy: float) -> None:
        self.store, self.timeout, self.busy = store, timeout, busy
        self.began = self.looked = self.said = time.monotonic()
        self.beats: dict[int, tuple[int, float]] = {}  # rank: (its count, when it last moved)

    def given_up(self, missing: list[int], generation: int, speaks: bool) -> bool:
        """Whether to stop waiting for ``missing``; ``speaks``: this rank says, once a minute, who is waited for."""
        now = time.monotonic()
        if now - self.looked < 0.5 and self.beats:
            return False
        self.looked = now
        for rank in missing:
            count = self.store.add(f"beat/{rank}", 0)
            if self.beats.get(rank, (None, 0.0))[0] != count:
                self.beats[rank] = (count, now)
        busy = [r for r in missing if now - self.beats[r][1] <= self.timeout]
        if not busy:
            return now - self.began > self.timeout
        if now - self.began > self.busy:
            return True
        if speaks and (now - self.said > 60 or (self.said == self.began and now - self.began > self.timeout)):
            self.said = now
            log.warning("elastic: generation %d waits for %s, alive in its own code (its heartbeat goes on): up to "
                        "AUTODIST_BUSY_TIMEOUT=%g s", generation, _ranks(busy), self.busy)
        return False


def beat(store: Any, rank: int, every: float = 1.0) -> None:
    """This rank's heartbeat, in a thread of its own, on a store client of its own: a count raised every
    ``every`` seconds while the process runs (a frozen process's stops)."""
    def beating() -> None:
        while True:
            try:
                store.add(f"beat/{rank}", 1)
            except Exception:  # noqa: BLE001 - the store (the launcher) is gone: the job is ending
                return
            time.sleep(every)
    threading.Thread(target=beating, name="autodist-elastic-heartbeat", daemon=True).start()


def _abort(group: dist.ProcessGroup) -> None:
    """Let the old generation's group go as far as the backend allows (gloo's abort in torch 2.13 ends no wait
    already under way: :meth:`Elastic.wait_for` is what ends those)."""
    try:
        group.abort()
    except Exception as exc:  # noqa: BLE001 - a backend without abort: its collectives end at the timeout
        log.debug("elastic: the old group could not be aborted: %s", exc)


def _reason(failed: BaseException | None) -> str:
    """Why the sync failed, in a few words: gloo's message without its source location and advice."""
    if failed is None or isinstance(failed, GaveUp):
        return "another rank's gradient sync failed"
    line = (str(failed).strip().splitlines() or [type(failed).__name__])[0]
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return "the gradient sync failed: " + line.split(". ", 1)[0][:120]


def _ranks(ranks: Any) -> str:
    ranks = list(ranks)
    return "none" if not ranks else ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Meeting:
    """The end of the script (:mod:`autodist.runtime.ending`): each member of the last generation arrives, and
    nobody waits for a rank the launcher saw end."""

    busy_words = ""

    def __init__(self, state: Elastic) -> None:
        self.state = state

    def _waiting_for(self) -> list[int]:
        here = {int(r) for r in self.state.store.get("end").decode().split(",") if r}
        gone = self.state.gone()
        return [r for r in self.state.members if r not in here and r not in gone]

    def arrive(self) -> None:
        self.state.store.append("end", f"{self.state.me},")
        while self._waiting_for():
            time.sleep(0.05)

    def missing(self) -> str:
        return f"{_ranks(self._waiting_for())} of the elastic job did not reach the end of the script"

    def give_up(self, message: str) -> None:
        log.error("%s", message)
        ending.leave(1, message)

    def busy_line(self, waited: float) -> str | None:
        return None  # no heartbeats in elastic mode: a missing rank cannot be told busy from hung


_elastic: Elastic | None = None


def start(world: World, launch: Launch, timeout: float, busy: float) -> Elastic:
    """This process's elastic state (made once, by every rank together); a client of the launcher's store, and
    another for the heartbeat."""
    global _elastic
    if _elastic is None:
        host, port = rendezvous_address(launch)

        def client() -> Any:
            return dist.PrefixStore(PREFIX, dist.TCPStore(host, port, is_master=False,
                                                          timeout=timedelta(seconds=max(timeout, 30.0))))
        beat(client(), world.rank)
        _elastic = Elastic(client(), world.rank, world.size, timeout, busy)
        ending.use_meeting(Meeting(_elastic))
    return _elastic


def current() -> Elastic | None:
    """The elastic state where the job is elastic and it was started; None otherwise."""
    return _elastic
