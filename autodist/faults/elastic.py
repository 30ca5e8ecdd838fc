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
arrival list. The list closes when every rank of the old generation has arrived or is gone; a missing rank
whose heartbeat (:func:`beat`) goes on, busy alone in its own code, is waited for up to
``AUTODIST_BUSY_TIMEOUT``, a silent one ``AUTODIST_TIMEOUT``. The first rank to close it writes the members
(again compare-and-set). The members make a new gloo group among themselves from the store alone (the
default group, which holds the lost rank, is not used again) and number themselves 0..n-1 in their old
order. A rank that arrives after the list closed is not a member: it raises, naming why. A rank whose
all-reduce waits for a peer that left does not wait for gloo's timeout: it watches the sync's outcome key
while it waits (:meth:`Elastic.wait_for`) and leaves once another rank wrote ``abort``.

A rank the launcher started again (``--max-restarts``; ``AUTODIST_ELASTIC_JOIN``: its member number, one no
rank had) appends itself to the ``join`` list and waits. The rank that completes a sync's count writes
``commit+join`` while the list is not empty, and at the step boundary after it (the loop asks for its next
batch) every member calls :meth:`Elastic.admit`: the first member sends the state (:mod:`autodist.dp.joining`),
and the next generation is the members and the ranks that asked. A rank still waiting when a member reaches
the end of its script leaves.

Example:
    >>> state = start(world, launch, 60.0, 1800.0)  # every rank, in parallelize, under autodist run --elastic
    >>> if not state.agree(completed=True):         # each sync: False if no rank applies it
    ...     state.regroup(error)                     # this rank's all-reduce error, or None
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from autodist.faults.liveness import FINISHED, Alive, Meeting, beat, listed, named
from autodist.runtime import ending
from autodist.runtime.environment import Launch, elastic_join, rendezvous_address
from autodist.runtime.world import World, follow_members, log

PREFIX = "autodist/elastic"  # the launcher writes gone ranks under it (see autodist.cli.keep_going)
GONE = "gone"  # "3,5," the ranks the launcher saw end badly
JOIN = "join"  # "6," the ranks (restarted by the launcher) waiting to join, admitted at the next step boundary
FALLBACK = "fallback"  # why this job cannot go on without a lost rank: the launcher restarts every rank instead
JOINABLE = "joinable"  # the job is elastic: the launcher may start a lost rank again, to join the others


class GaveUp(RuntimeError):
    """Another rank wrote ``abort`` for this sync while this rank's all-reduce still waited."""


class LeftOut(RuntimeError):
    """This rank arrived at a generation after its members were fixed: the others went on without it."""


class Elastic:
    """This rank's place in the ranks that are alive together: the generation, its members (ranks of the
    launch, in order), the group they sum over, and the count of syncs agreed on in it."""

    def __init__(self, store: Any, me: int, members: tuple[int, ...], timeout: float, busy: float,
                 generation: int = 0) -> None:
        self.store, self.me, self.timeout, self.busy = store, me, timeout, busy
        self.generation = generation
        self.members = members
        self.syncs = 0  # the syncs of this generation agreed on (committed or aborted)
        self.committed = 0  # every sync committed since the start, in every generation
        self.admitting = False  # the last sync committed with ranks waiting to join: admit them before the next
        self.joined_with: bytes | None = None  # a rank that joined: the state the first member sent it
        self.joined_epoch: int | None = None  # and the epoch its loop goes on with (autodist.resume says it)
        self.group = self._group()

    @property
    def rank(self) -> int:
        """This rank's index among the members."""
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)

    def _group(self) -> dist.ProcessGroup:
        """The generation's gloo group, made from the store alone (not from the default group, which holds
        ranks that are gone and not ranks that joined since); member i is its rank i."""
        return gloo_group(dist.PrefixStore(f"{self.generation}/group", self.store), self.rank, self.size,
                          self.timeout)

    def gone(self) -> set[int]:
        """The ranks the launcher saw end badly so far."""
        text = self.store.get(GONE).decode() if self.store.check([GONE]) else ""
        return set(listed(text))

    # -- each sync -------------------------------------------------------------------------------
    def agree(self, completed: bool) -> bool:
        """Whether every rank of the generation applies this sync (each rank calls it once per sync, with
        whether its own all-reduce ``completed``); the same answer on every rank that gets one."""
        self.syncs += 1
        key = f"{self.generation}/sync/{self.syncs}"
        if completed:
            if self.store.add(f"{key}/done", 1) == self.size:
                waiting = self.store.check([JOIN]) and self.store.get(JOIN) != b""
                self.store.compare_set(f"{key}/outcome", "", "commit+join" if waiting else "commit")
                if self.syncs > 1:  # every rank is past the previous sync's outcome: its keys can go
                    before = f"{self.generation}/sync/{self.syncs - 1}"
                    self.store.delete_key(f"{before}/done")
                    self.store.delete_key(f"{before}/outcome")
        else:
            self.store.compare_set(f"{key}/outcome", "", "abort")
        outcome = self._outcome(f"{key}/outcome")
        self.committed += outcome.startswith("commit")
        self.admitting = outcome == "commit+join"
        return outcome.startswith("commit")

    def admit(self, state: Callable[[], bytes]) -> None:
        """After a sync that committed with ranks waiting to join (every member calls it, at the step boundary:
        the loop asks for its next batch): the next generation is the members and the ranks waiting, in that
        order; the first member sends them ``state()`` (the model, the optimizers, the loaders' places)."""
        nxt = self.generation + 1
        self.admitting = False
        if self.rank == 0:  # each write recoverable if this rank dies after it (see _join and the failure below)
            gone = self.gone()
            joiners = list(dict.fromkeys(r for r in listed(self.store.get(JOIN).decode())
                                         if r not in self.members and r not in gone))
            _send_state(self.store, nxt, state() if joiners else b"")  # (every joiner in the list was lost)
            _fix_members(self.store, nxt, [*self.members, *joiners])
            _tell_joiners(self.store, nxt, joiners)
            _take_off(self.store, joiners)  # last: until here a joiner stays asked for, for the next admission
        try:
            self.store.wait([f"{nxt}/members"], timedelta(seconds=self.timeout))
        except dist.DistStoreError:  # the first member was lost before it wrote them: meet without it
            self.regroup(None)
            return
        fixed = listed(self.store.get(f"{nxt}/members").decode())
        joined = [r for r in fixed if r not in self.members]
        before = self.members
        self.generation, self.members, self.syncs = nxt, fixed, 0
        try:
            self.group = self._group()
        except Exception as exc:  # noqa: BLE001 - a member or a joining rank was lost as the group formed
            self.members = before  # the joiners wait to be asked again: nobody waits for them in the regroup
            self.regroup(exc)
            return
        if self.rank == 0:  # every joiner read the state before it made the group with the members: it can go
            self.store.delete_key(f"{nxt}/state")
        if self.rank == 0 and joined:
            log.warning("elastic: %s joined at a step boundary (a rank the launcher started again), with the "
                        "weights, optimizer state and data position of rank %d; %s go on as generation %d, each "
                        "global batch split over them", named(joined, "member"), fixed[0], named(fixed), nxt)

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
                    raise GaveUp("another rank's sum failed")
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def sum_(self, t: torch.Tensor) -> None:
        """``t`` summed in place over this generation's group; raises where a member was lost before or during
        it, or another rank gave the sync up (the caller decides what becomes of the step)."""
        work = dist.all_reduce(t, group=self.group, async_op=True)
        self.wait_for([work])
        work.wait()

    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` summed over the ranks alive together, under the sync's rules (every member calls it where it
        would call a collective, e.g. ``engine.Metrics.reduce``): agreed on as a sync is; where it fails (a
        member lost before or during it, or busy in its own code past ``AUTODIST_TIMEOUT``) the ranks left
        regroup as after a failed sync and sum again. ``what``: the sum in words, for the regroup's line.

        Example:
            >>> sums = current().all_reduce(torch.tensor([loss_sum, correct, count]), "metrics' sum")
        """
        committed = self.committed  # no step: the loader's count of applied steps does not move
        while True:
            summed, failed = t.clone(), None
            try:
                self.sum_(summed)
            except Exception as exc:  # noqa: BLE001 - a peer's connection reset, or the group's timeout
                failed = exc
            agreed = self.agree(failed is None)
            self.committed = committed
            if agreed:
                return summed
            self.regroup(failed, what, "it was summed again over the ranks left")

    def _outcome(self, key: str) -> str:
        """The sync's word, once written (the store wakes the wait: no polling); ``abort`` written here if it
        is not written within ``AUTODIST_TIMEOUT``: a member ended between its all-reduce and its count."""
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except dist.DistStoreError:
            return self.store.compare_set(key, "", "abort").decode()
        return self.store.get(key).decode()

    # -- a new generation --------------------------------------------------------------------------
    def regroup(self, failed: BaseException | None, what: str = "gradient sync",
                then: str = "the step in flight was abandoned (no rank applied it)") -> None:
        """Meet the ranks left in the next generation and sum over them from now on (see the module
        docstring); ``failed``: this rank's collective's error (None: another rank's failed); ``what``: the
        sum that failed, and ``then``: what became of it, in words. Raises :class:`LeftOut` if they went on
        without this rank."""
        began = time.monotonic()
        _abort(self.group)  # this rank is done with it (its peers' waits end by wait_for: gloo's abort does not)
        nxt = self.generation + 1
        arrived, members = f"{nxt}/arrived", f"{nxt}/members"
        self.store.append(arrived, f"{self.me},")
        alive = Alive(self.store, self.timeout, self.busy)
        while not self.store.check([members]):
            here = set(listed(self.store.get(arrived).decode()))
            gone = self.gone()
            missing = [r for r in self.members if r not in here and r not in gone]
            if not missing or alive.given_up(missing, nxt, speaks=self.me == min(here)):
                chosen = ",".join(str(r) for r in self.members if r in here and r not in gone)
                self.store.compare_set(members, "", chosen)
                break
            time.sleep(0.01)
        fixed = listed(self.store.get(members).decode())
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
            self.regroup(exc, what, then)
            return
        if self.rank == 0 and not lost:
            log.warning("elastic: the %s was given up (%s) while a rank was busy in its own code past "
                        "AUTODIST_TIMEOUT; %s, and %s go on as generation %d, the same ranks (%.2f s to regroup)",
                        what, _reason(failed, what), then, named(fixed), nxt, time.monotonic() - began)
        elif self.rank == 0:
            log.warning("elastic: lost %s (%s); %s, and %s %s on as generation %d, each global batch split over "
                        "%s: the same training (%.2f s to regroup)", named(lost), _reason(failed, what), then,
                        named(fixed), "goes" if len(fixed) == 1 else "go", nxt, "it" if len(fixed) == 1 else "them",
                        time.monotonic() - began)


def _abort(group: dist.ProcessGroup) -> None:
    """Let the old generation's group go as far as the backend allows (gloo's abort in torch 2.13 ends no wait
    already under way: :meth:`Elastic.wait_for` is what ends those)."""
    try:
        group.abort()
    except Exception as exc:  # noqa: BLE001 - a backend without abort: its collectives end at the timeout
        log.debug("elastic: the old group could not be aborted: %s", exc)


def _reason(failed: BaseException | None, what: str = "gradient sync") -> str:
    """Why the sync failed, in a few words: gloo's message without its source location and advice."""
    if failed is None or isinstance(failed, GaveUp):
        return f"another rank's {what} failed"
    if isinstance(failed, ValueError) and "world group map" in str(failed) and failed.__context__ is not None:
        failed = failed.__context__  # torch's logging of the collective's error failed on the regrouped group
    line = (str(failed).strip().splitlines() or [type(failed).__name__])[0]
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return f"the {what} failed: " + line.split(". ", 1)[0][:120]


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
        me = elastic_join()
        beat(client(), world.rank if me is None else me)
        _elastic = Elastic(client(), world.rank, tuple(range(world.size)), timeout, busy) if me is None else \
            _join(client(), me, timeout, busy)
        _elastic.store.set(JOINABLE, "1")
        follow_members(lambda: (_elastic.rank, _elastic.size) if _elastic is not None else (world.rank, world.size))
        ending.use_meeting(Meeting(_elastic))
    return _elastic


def gloo_group(store: Any, rank: int, size: int, timeout: float) -> dist.ProcessGroup:
    """A gloo process group of ``size`` ranks met through ``store`` alone, outside torch's registry of groups
    (``new_group`` needs every rank of the default group, which holds ranks that are gone). Built from torch's
    private parts (``ProcessGroup._register_backend``): the one place that does, checked by
    tests/faults/test_elastic_group.py on each torch version."""
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def fall_back(launch: Launch, rank: int, why: str) -> None:
    """A job under ``--elastic`` that cannot go on without a lost rank (``why``): it runs as without
    ``--elastic`` (the watchdog names a lost rank and every rank stops), and the launcher, told through the
    store, starts every rank again to resume from the last checkpoint (``--max-restarts``)."""
    host, port = rendezvous_address(launch)
    client = dist.PrefixStore(PREFIX, dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60)))
    client.set(FALLBACK, why)
    if rank == 0:
        log.warning("elastic: this job cannot go on without a lost rank (%s); a lost rank stops every rank, and "
                    "with --max-restarts the launcher starts them all again, to resume from the last checkpoint "
                    "(autodist.resume: docs/checkpoints.md)", why)


def _join(store: Any, me: int, timeout: float, busy: float) -> Elastic:
    """A rank restarted into a running job: it asks to join, and the members admit it after their next step
    (:meth:`Elastic.admit`), the first of them sending it their state."""
    log.info("elastic: started again, this rank asks to join the others as member %d; they admit it after "
             "their next step", me)
    key = f"joined/{me}"
    began = time.monotonic()
    while True:
        store.append(JOIN, f"{me},")
        while not store.check([key]):
            if store.check([FINISHED]):
                log.warning("elastic: the job finished before member %d could join; it leaves", me)
                ending.leave(0)
            if time.monotonic() - began > busy:
                raise LeftOut(f"member {me} asked to join the elastic job and was not admitted within "
                              f"AUTODIST_BUSY_TIMEOUT={busy:g} s: the others take no step (stuck, or busy alone)")
            time.sleep(0.05)
        generation = int(store.get(key).decode())
        members = listed(store.get(f"{generation}/members").decode())
        sent = store.get(f"{generation}/state")  # before the group forms: the first member deletes it after
        try:
            state = Elastic(store, me, members, timeout, busy, generation)
        except Exception as exc:  # noqa: BLE001 - the admission failed (a member lost as the group formed)
            store.delete_key(key)
            log.warning("elastic: member %d's admission failed (%s); it asks again", me, _reason(exc, "group"))
            continue
        state.joined_with = sent
        return state


# The admission's writes, in order (Elastic.admit); the first member may die after any of them.
def _send_state(store: Any, generation: int, blob: bytes) -> None:
    """The state the joiners load (deleted once they formed the group with the members)."""
    store.set(f"{generation}/state", blob)


def _fix_members(store: Any, generation: int, members: list[int]) -> None:
    """The next generation's members; the other members wait for it (a regroup if it never comes)."""
    store.compare_set(f"{generation}/members", "", ",".join(map(str, members)))


def _tell_joiners(store: Any, generation: int, joiners: list[int]) -> None:
    """Each joiner's word: the generation it is a member of (it asks again if that group fails to form)."""
    for rank in joiners:
        store.set(f"joined/{rank}", str(generation))


def _take_off(store: Any, ranks: list[int]) -> None:
    """Remove ``ranks`` from the join list (a rank that asks meanwhile stays on it, for the next admission)."""
    while ranks:
        text = store.get(JOIN).decode()
        rest = "".join(f"{r}," for r in listed(text) if r not in ranks)
        if store.compare_set(JOIN, text, rest).decode() == rest:
            return


def current() -> Elastic | None:
    """The elastic state where the job is elastic and it was started; None otherwise."""
    return _elastic
