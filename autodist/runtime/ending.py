"""The end of a script on every rank: work in flight settled, the ranks leaving together within a bound,
then the process group torn down.

At exit (one ``atexit`` hook, registered by :func:`autodist.runtime.world.init`):

1. every callable registered with :func:`settle_at_exit` settles what it still has in flight (Gossip's
   last exchange, streamed DiLoCo's averages under way, a parameter server's last conversation), and the
   communication that owners dropped before the end left in flight (:func:`wait_at_exit`) is waited for;
2. the ranks meet: through the watchdog where one runs (:func:`use_meeting`; it also counts a rank that
   failed or fell silent as arrived), otherwise through the rendezvous store;
3. the process group is destroyed;
4. autodist's own threads that call into torch (the watchdog, the elastic heartbeat) stop
   (:func:`stop_at_exit`).

Steps 1 and 2 are bounded: after ``AUTODIST_EXIT_TIMEOUT`` seconds (60 by default) the rank prints one
line naming the ranks that did not arrive and leaves with status 1; with the watchdog, every other rank
stops with it. A rank that dies of an exception skips both (its peers learn of it from the watchdog).

Example:
    >>> ending.settle_at_exit(gossip.settle, weakly=True)   # a strategy with messages under way at the end
    >>> ending.forget(gossip.settle)                        # removed: nothing to settle any more
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable, Protocol

import torch.distributed as dist

from autodist.runtime.environment import error_file, exit_timeout
from autodist.runtime.position import waiting

log = logging.getLogger("autodist")

_STORE_PREFIX = "autodist/runtime/ending/"


class Meeting(Protocol):
    """How the ranks meet at the end of their scripts."""

    busy_words: str  # how long a missing rank alive in its own code is waited for, in words

    def arrive(self) -> None:
        """Say this rank arrived; return once every rank has (or can no longer)."""

    def missing(self) -> str:
        """The ranks that did not arrive (and where they are), in words; "" where every rank has arrived by now
        (one may arrive between the deadline's two questions: the meeting then ends by itself)."""

    def give_up(self, message: str) -> None:
        """Print ``message``, stop every rank that can be reached, and leave with status 1 (never returns)."""

    def busy_line(self, waited: float) -> str | None:
        """``waited`` seconds after this rank arrived: a progress line while the missing ranks are alive in
        their own code and are still waited for ("" to wait on without a line), or None to give up now."""


class StoreMeeting:
    """The ranks meet through the rendezvous store: a key per rank that arrived."""

    busy_words = ""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size

    def arrive(self) -> None:
        try:
            self.store.set(f"arrived/{self.rank}", "1")
            keys = [f"arrived/{r}" for r in range(self.size)]
            while not self.store.check(keys):
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - rank 0, which hosts the store, left: it had seen everyone arrive
            log.debug("at exit: the rendezvous store stopped answering: %s", exc)

    def missing(self) -> str:
        late = [r for r in range(self.size) if not self.store.check([f"arrived/{r}"])]
        return f"{_ranks(late)} did not reach the end of the script" if late else ""

    def give_up(self, message: str) -> None:
        log.error("%s", message)
        leave(1, message)

    def busy_line(self, waited: float) -> str | None:
        return None  # no heartbeats: a missing rank cannot be told busy from hung


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_settlers: list[Callable[[], Callable[[], None] | None]] = []  # each gives its settle(), or None once it is gone
_orphans: list["InFlight"] = []  # communication in flight whose owner is gone
_meeting: Meeting | None = None
_stops: list[Callable[[], None]] = []  # each ends a thread of autodist's that calls into torch (stop_at_exit)
STOP_WAIT_S = 5.0  # how long the end waits for one such thread to leave a request under way


def settle_at_exit(settle: Callable[[], None], *, weakly: bool = False) -> None:
    """Have ``settle()`` called at the end of the script, on every rank, before the ranks meet: it waits for,
    or abandons alike on every rank, the communication its owner still has in flight. Held until
    :func:`forget`; ``weakly`` (a bound method): only while its object lives, so that a strategy the script
    dropped is freed with its model (it hands what it left in flight to :func:`wait_at_exit`). A parameter
    server must still talk to the others at the end, so it is held strongly."""
    _settlers[:] = [s for s in _settlers if s() is not None]
    _settlers.append(weakref.WeakMethod(settle) if weakly else lambda: settle)  # type: ignore[arg-type]


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Have ``stop()`` called at the very end of :func:`shutdown` (after the meeting and the teardown, and on a
    rank dying of an error too): it ends a daemon thread of autodist's that calls into torch, and waits for it
    (at most :data:`STOP_WAIT_S`). Such a thread, inside a store request when the interpreter begins to
    finalize, is ended by the interpreter as it takes its lock back, through C++ frames that cannot be unwound:
    the process aborts ("terminate called without an active exception"; seen in the elastic heartbeat's
    ``store.add``: 1 elastic job in 45 at 2 ranks, here)."""
    _stops.append(stop)


def join_thread(thread: threading.Thread) -> None:
    """Wait for ``thread``, told to stop, to end (at most :data:`STOP_WAIT_S`; not from within itself)."""
    if thread.is_alive() and threading.current_thread() is not thread:
        thread.join(timeout=STOP_WAIT_S)


def _stop_threads() -> None:
    stops, _stops[:] = list(_stops), []
    for stop in stops:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - the process is ending: the other threads still stop
            log.debug("at exit: %s", exc)


def forget(settle: Callable[[], None]) -> None:
    """Nothing left to settle at exit for ``settle``'s owner (it was removed or closed)."""
    _settlers[:] = [s for s in _settlers if s() is not None and s() != settle]


class InFlight:
    """The communication an owner has under way: torch's work objects (each holds the tensors it reads and
    writes), handed to :func:`wait_at_exit` when the owner is collected before it waited for them.

    Example:
        >>> flight = InFlight(strategy)                # strategy dropped: its works are waited for at exit
        >>> flight.add([dist.all_reduce(t, async_op=True)])
    """

    def __init__(self, owner: object) -> None:
        self.works: list[Any] = []
        self.note: str | None = None  # logged if the exit waits for these works (the owner's words)
        weakref.finalize(owner, wait_at_exit, self)

    def add(self, works: Any) -> None:
        """More work under way (the finished work is let go)."""
        self.works = [w for w in self.works if not _completed(w)] + list(works)

    def waited(self) -> None:
        """The owner waited for some of its works: let the finished ones go (with the buffers they hold)."""
        self.add([])


def wait_at_exit(flight: InFlight) -> None:
    """Communication in flight that its owner (a strategy whose model the script dropped, or whose script
    ended) no longer waits for: held (each work holds the buffers it reads and writes) until
    :func:`finish_orphans` or the exit waits for it, since its peers finish the same messages. Called when the
    owner is collected, which may be in any thread: it never waits here."""
    flight.works = [w for w in flight.works if not _completed(w)]
    if flight.works:
        _orphans.append(flight)


def finish_orphans() -> None:
    """Wait for the communication dropped owners left in flight, and let it go. Call it where every rank has
    started all of it: after a collective that each reaches only after the work was started everywhere (the
    next ``parallelize``), so the wait is short and cannot meet a peer that never sends."""
    orphans, _orphans[:] = list(_orphans), []
    with waiting("the end of the communication a dropped model's strategy left in flight"):
        for flight in orphans:
            for work in flight.works:
                work.wait()


def _wait_for(flight: InFlight) -> None:
    """At exit: an orphan's works, then its owner's note."""
    for work in flight.works:
        work.wait()
    if flight.note:
        log.warning("%s", flight.note)


def _completed(work: Any) -> bool:
    done = getattr(work, "is_completed", None)
    return bool(done()) if callable(done) else False


def use_meeting(meeting: Meeting | None) -> None:
    """The watchdog's meeting replaces the store's (None: back to the store's)."""
    global _meeting
    _meeting = meeting


def record_error(line: str, callstack: str = "", *, verdict: bool = False, path: str | None = None,
                 status: int = 1) -> None:
    """Write this rank's error where the launcher looks for it (torchrun's error file, with the exact time,
    line and the exit status the rank is leaving with, for ``autodist run``'s summary); ``verdict``: the
    watchdog's, naming another rank's fault. Nothing is written without a launcher that asks for it."""
    path = path or error_file()
    if not path:
        return
    if not verdict and _holds_verdict(path):
        return  # the watchdog's verdict stays: what the main thread raises afterwards follows from it
    now = time.time()
    data = {"message": {"message": line, "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))}},
            "autodist": {"time": now, "line": line, "verdict": verdict, "status": status}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then names the rank and exit code without the line: no reason to fail the rank


def _holds_verdict(path: str) -> bool:
    try:
        with open(path) as f:
            return bool(json.load(f).get("autodist", {}).get("verdict"))
    except (OSError, ValueError, AttributeError):
        return False


def leave(code: int, verdict: str | None = None) -> None:
    """Leave now with ``code``, output flushed: the main thread may be blocked in a call that never returns.
    ``verdict``: why every rank stops (the watchdog's words), recorded for the launcher's summary."""
    if verdict is not None:
        record_error(verdict.splitlines()[0], verdict=True, status=code)
    for handler in log.handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _store_meeting() -> Meeting | None:
    try:
        store = dist.PrefixStore(_STORE_PREFIX, dist.distributed_c10d._get_default_store())
    except Exception:  # noqa: BLE001 - a process group started without a store: meet in a barrier instead
        return None
    return StoreMeeting(store, dist.get_rank(), dist.get_world_size())


class _Bound:
    """The deadline of the end: past it, the meeting gives up, naming who is missing."""

    def __init__(self, meeting: Meeting | None, seconds: float) -> None:
        self.meeting, self.seconds, self.started = meeting, seconds, time.monotonic()
        self.busy = False  # past the bound, the missing ranks were found alive in their own code: waited for
        self.again = False  # armed again once because every rank had arrived by the time it asked
        self.over = threading.Event()  # the meeting ended: no timer is armed again
        self.timer = self._arm(seconds)

    def _arm(self, seconds: float) -> threading.Timer:
        self.timer = threading.Timer(seconds, self._expired)
        self.timer.daemon = True
        self.timer.name = "autodist-exit-bound"
        return self.timer

    def start(self) -> None:
        self.timer.start()

    def cancel(self) -> None:
        self.over.set()
        self.timer.cancel()
        join_thread(self.timer)  # it may be asking the store where the others are

    def _expired(self) -> None:
        waited, line = time.monotonic() - self.started, None
        try:
            line = self.meeting.busy_line(waited) if self.meeting is not None else None
        except Exception as exc:  # noqa: BLE001 - the store is gone: give up below
            log.debug("at exit: %s", exc)
        if self.over.is_set():
            return
        if line is not None:  # the missing ranks are alive in their own code (or arrived meanwhile): wait on
            if line:
                log.warning("%s", line)
            self.busy = True
            self._arm(min(60.0, self.seconds)).start()
            if self.over.is_set():
                self.timer.cancel()
            return
        try:
            who = self.meeting.missing() if self.meeting is not None else "the other ranks did not arrive"
        except Exception as exc:  # noqa: BLE001
            who = f"the other ranks cannot be asked ({exc})"
        if not who and not self.again:  # the last rank arrived just now, after busy_line looked: the meeting
            self.again = True  # ends by itself; once, so that a meeting that does not is still given up
            self._arm(min(60.0, self.seconds)).start()
            if self.over.is_set():
                self.timer.cancel()
            return
        who = who or "every rank said it arrived, yet the meeting did not end"
        limit = (f"AUTODIST_EXIT_TIMEOUT={self.seconds:g} s; raise it if a rank legitimately finishes this much "
                 f"later") if not self.busy else \
            f"{self.meeting.busy_words}: how long a rank alive in its own " \
            f"code is waited for; raise it if a rank is legitimately busy this long"
        message = (f"rank {dist.get_rank()} reached the end of its script and waited {waited:.0f} s for the "
                   f"others: {who} ({limit})")
        if self.meeting is not None:
            try:
                self.meeting.give_up(message)  # prints it, stops the others, leaves
            except Exception as exc:  # noqa: BLE001 - the store is gone: leave alone
                log.debug("at exit: could not stop the other ranks: %s", exc)
        log.error("%s", message)
        leave(1, message)


def _settle() -> bool:
    """Every registered settle() whose owner lives, then the orphans' waits; False if one failed (it says
    why)."""
    fine = True
    settles = [s() for s in _settlers]
    waits = [partial(_wait_for, flight) for flight in _orphans]
    for settle in [s for s in settles if s is not None] + waits:
        try:
            with waiting("exit"):  # a lost peer is named (the watchdog's explanation), not gloo's socket error
                settle()
        except Exception as exc:  # noqa: BLE001 - one line, then the others still settle and the ranks still meet
            log.error("at the end of the script: %s", str(exc).strip().splitlines()[0] if str(exc).strip()
                      else type(exc).__name__)
            fine = False
    _settlers.clear()
    _orphans.clear()
    return fine


def shutdown(destroy: bool = True) -> None:
    """At exit: settle, meet (bounded), tear the process group down (``destroy``: autodist started it).

    gloo's worker threads release finished work objects after the caller has seen them complete, and
    releasing one can need the GIL; if the interpreter is already finalizing by then, the process aborts
    at exit ("terminate called without an active exception"). So the group is destroyed and garbage
    collected while the interpreter is whole, with a moment for those threads to finish. Last, autodist's own
    threads that call into torch stop (:func:`stop_at_exit`), for the same reason.
    """
    if not (dist.is_available() and dist.is_initialized()):  # the script destroyed the group itself
        _stop_threads()
        return
    fine = True
    # A rank dying of an unhandled exception neither settles nor meets: its peers may be inside a collective
    # that nothing here must be matched with; the watchdog tells them.
    if getattr(sys, "last_value", None) is None:
        meeting = _meeting or _store_meeting()
        bound = _Bound(meeting, exit_timeout())
        bound.start()
        try:
            fine = _settle()
            with waiting("exit"):
                if meeting is not None:
                    meeting.arrive()
                else:
                    dist.barrier()
        except Exception as exc:  # noqa: BLE001 - a peer that died already: tear down what is left anyway
            log.debug("at exit: %s", exc)
        finally:
            bound.cancel()
    if destroy:
        _tear_down()
    _stop_threads()
    if not fine:
        leave(1)


def _tear_down() -> None:
    """The process group destroyed and its finished work collected while the interpreter is whole, with a moment
    for gloo's threads to let go of it (see :func:`shutdown`)."""
    dist.destroy_process_group()
    gc.collect()
    time.sleep(0.1)


def end_a_group_left_alive() -> None:
    """At the very end of a rank of ``autodist run`` (registered before the script runs, so after autodist's own
    end): a gloo process group that the script started itself and left alive (Hugging Face Trainer's,
    Accelerate's, a DDP script without ``destroy_process_group``) is torn down as :func:`shutdown` tears down
    autodist's, instead of aborting the process at exit now and then ("terminate called without an active
    exception": gloo's threads releasing work after the interpreter began finalizing). NCCL's is left to its
    starter: destroying it alone can wait for the other ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            _tear_down()
        except Exception as exc:  # noqa: BLE001 - the process is ending; a peer gone already is no error here
            log.debug("at exit: %s", exc)
