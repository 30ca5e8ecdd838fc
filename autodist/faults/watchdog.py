"""Hangs become named errors: progress heartbeats through the rendezvous store torch.distributed already has.

One daemon thread per rank publishes, once a tick (1 s), where this rank is
(:mod:`autodist.runtime.position`: the step its loader handed out, the gradient sync
it waits in, its Python stack when it stands still) into the default process
group's store, under a prefix of its own, and reads the verdict and the digest
in one request; the training loop itself only updates a few local attributes.
One rank, the reader (:mod:`autodist.faults.reader`), also reads every status
once a tick and judges for each rank that waits in a collective: it stops
every rank with one error naming who is where when

* another rank failed (its exception's last line is published by an
  excepthook before it dies) or ended its script: at once;
* the wait passes the timeout (``AUTODIST_TIMEOUT``, 60 s by default) while a
  rank it waits for is silent, or waits in another collective: the message
  names the ranks that did not arrive, with their Python stacks;
* the ranks it waits for are alive and in their own code (evaluating or saving
  alone): past ``AUTODIST_TIMEOUT`` the lowest waiting rank prints where they
  are once a minute, and the wait passes the busy limit
  (``AUTODIST_BUSY_TIMEOUT``, 30 minutes by default) before the same message.

The verdict goes into the store in the name of the rank it is found for, which
prints it as its own; every other rank's thread reads it within a tick, prints
one line and exits with status 1 (rank 0, whose process holds the store, last). A
collective that fails because a peer died (gloo's "Connection closed by
peer", or a fence in shared memory that finds the peer's process gone) is
explained the same way: the peer that published its failure, or
the one whose heartbeat stopped. At a normal end every rank waits in an
atexit hook until all have ended, so a rank that ends early is seen by
the others instead of hanging them.

Example:
    >>> watchdog.start(rank=0, size=2, timeout=60.0)   # parallelize does this
    >>> with position.waiting("sync"):                  # around a blocking collective: named if it hangs
    ...     work.wait()
"""
from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from autodist.faults.reader import AT_THE_END, NAMED, STALE_TICKS, Digest, Reader, first_readers, gone
from autodist.faults.verdicts import Status, in_own_code, still_waiting
from autodist.faults.verdicts import where as where_is
from autodist.runtime import ending, position
from autodist.runtime.position import record, wait_words, waiting
from autodist.runtime.shared_fence import PeerGone
from autodist.runtime.world import collective_timeout, log

_PREFIX = "autodist/faults/watchdog/"
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "Socket closed")
_EXIT_CODE = 1
HELD_FRAME_LOOK_S = 0.02  # how often a held frame of the main thread is checked for having been left


class PeerFailure(RuntimeError):
    """A collective failed because another rank is gone; the message says which and why."""


def is_peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (PeerFailure, PeerGone)) or \
        (isinstance(exc, RuntimeError) and any(m in text for m in _PEER_LOST))


# -- the thread ------------------------------------------------------------------------------------

def _main_frame_in_collective(frame: Any) -> tuple[Any, str] | None:
    """If the innermost Python frame is inside torch.distributed: the API frame called, and that call in words."""
    if frame is None or not _in_torch_distributed(frame):
        return None
    api, name = frame, frame.f_code.co_name
    while api.f_back is not None and _in_torch_distributed(api.f_back):
        api = api.f_back
        if api.f_code.co_filename.endswith("distributed_c10d.py"):
            name = api.f_code.co_name  # the API function, not the logging wrapper around it
    if api.f_back is not None and api.f_back.f_code.co_filename.startswith("<frozen importlib"):
        return None  # a module of torch.distributed being imported (its first use), not a call waiting for peers
    callers, caller = [], api.f_back
    while caller is not None and len(callers) < 4:  # through autodist's own frames to the script's line
        callers.append(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} in {caller.f_code.co_name}")
        if f"{os.sep}autodist{os.sep}" not in caller.f_code.co_filename:
            break
        caller = caller.f_back
    return api, f"torch.distributed.{name} called at {' <- '.join(callers) or 'top level'}"


def _in_torch_distributed(frame: Any) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename


def _stack(frame: Any, limit: int = 12) -> str:
    return "".join(traceback.format_stack(frame)[-limit:])


_LIBRARIES = tuple(os.path.join(d, "") for d in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)),
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def _script_lines(frame: Any, count: int = 2) -> str | None:
    """The innermost lines of the script's own code on a stack (not torch's, autodist's or Python's), in
    words: where a rank that runs its own code is, e.g. ``model.py:54 in forward <- train.py:120 in
    estimate_loss``."""
    lines = []
    while frame is not None and len(lines) < count:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARIES) and not name.startswith("<"):
            lines.append(f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(lines) or None


class Watchdog:
    """The heartbeat thread of one rank, and the decisions that stop every rank."""

    def __init__(self, store: Any, rank: int, size: int, timeout: float, ident: int, busy: float,
                 busy_words: str) -> None:
        self.store, self.rank, self.size, self.timeout, self.ident = store, rank, size, timeout, ident
        self.busy = max(timeout, busy)  # a rank alive in its own code: waited for (:func:`_busy_limit`)
        self.busy_words = busy_words
        self.tick = min(1.0, timeout / 5)
        self.wait_since = 0.0  # when the wait the main thread is in began (monotonic)
        self.leaving = False  # a verdict stops this rank: nothing more goes to the store but its acknowledgement
        self.status = Status(rank=rank, host=socket.gethostname(), pid=os.getpid())
        self.reader: Reader | None = None  # while this rank reads every status (:mod:`autodist.faults.reader`)
        self.digest: Digest | None = None  # the reader's last digest, as this rank last read it
        self.digest_text = b""
        self.digest_since = time.monotonic()  # when this rank saw the digest change last
        self.said: str | None = None  # the id of the last progress line the digest gave this rank to say
        self.stop = threading.Event()
        self.report_lock = threading.Lock()
        self.reported = False
        self.top: tuple | None = None  # the main thread's innermost (frame id, instruction, progress)
        self.top_since = 0.0
        self.collective: tuple[Any, str, float] | None = None  # (api frame, words, first seen) of a torch call
        self.store_lost: str | None = None  # why the store stopped answering; None while it answers
        self.thread = threading.Thread(target=self._run, name="autodist-watchdog", daemon=True)

    # -- publishing --------------------------------------------------------------------------------
    def _observe(self, now: float) -> None:
        """Refresh self.status from the record and the main thread's stack."""
        st, frame = self.status, sys._current_frames().get(self.ident)
        top = (id(frame), getattr(frame, "f_lasti", -1), record.progress, record.wait_seq)
        if top != self.top:
            self.top, self.top_since = top, now
        st.stuck_s = now - self.top_since
        st.state, st.note, st.syncs = record.state, record.note, record.syncs
        st.position = list(record.position) if record.position else None
        st.data_end = list(record.data_end) if record.data_end else None
        wait, st.at = record.wait, None
        if wait is not None:
            st.wait, st.wait_s, self.wait_since = wait_words(*wait), now - record.wait_since, record.wait_since
            self.collective = None
        else:
            found = _main_frame_in_collective(frame)
            if found is None:
                self.collective = None
                st.wait, st.wait_s, st.at = None, 0.0, _script_lines(frame)
            else:
                held = self.collective  # read once: another thread may observe (and drop it) meanwhile
                if held is None or held[0] is not found[0]:
                    held = self.collective = (found[0], found[1], now)  # holding the frame keeps its identity
                st.wait, st.wait_s, self.wait_since = found[1], now - held[2], held[2]
        st.stack = _stack(frame) if frame is not None and (st.stuck_s >= 2 * self.tick or st.wait) else None

    def publish(self) -> None:
        self.status.seq += 1
        self.status.wall = time.time()
        self.store.set(f"status/{self.rank}", self.status.dumps())

    def look(self) -> Digest | None:
        """The verdict (acted on, if there is one) and the reader's digest, in one request."""
        verdict, text = self.store.multi_get(["verdict", "digest"])
        if verdict:
            self.act_on(verdict.decode())
        if text != self.digest_text:
            self.digest_text, self.digest_since = text, time.monotonic()
            self.digest = Digest.loads(text) if text else None
        return self.digest

    def _reads(self) -> bool:
        """Whether this rank reads every status this tick: it wrote the last digest, or that digest is older than
        its place among the successors allows (the reader frozen, or gone while the store lives)."""
        digest = self.digest
        if digest is not None and digest.by == self.rank:
            return True
        order = [digest.by, *digest.successors] if digest is not None else \
            first_readers(self.size, self.reader.left if self.reader is not None else set())
        if self.rank not in order:
            self.reader = None
            return False
        if time.monotonic() - self.digest_since < order.index(self.rank) * STALE_TICKS * self.tick:
            self.reader = None  # another rank reads (again)
            return False
        return True

    def _read(self) -> None:
        """Read every status, judge, write the digest. A verdict goes into the store in the name of the rank it
        is found for, which prints it as its own (this rank now, another within a tick); this rank acts on it."""
        if self.reader is None:
            self.reader = Reader(self.store, self.rank, self.size, self.timeout, self.tick, self.busy, self.busy_words)
            old = self.digest
            if old is not None and old.by != self.rank:  # taking over: the old reader last lived at its last digest
                self.reader.since(old.by, -2, self.digest_since)
        verdict, digest = self.reader.turn(self.status)
        self.digest, self.digest_text, self.digest_since = digest, digest.dumps().encode(), time.monotonic()
        if verdict is not None:  # this rank's own (printed as decided here), or another's (obeyed)
            rank, message = verdict
            self.act_on(self.store.compare_set("verdict", "", f"{rank}\n{message}").decode())

    def _say(self, said: list) -> None:
        """A progress line the digest gives this rank: printed once."""
        if said[0] != self.said:
            self.said = said[0]
            log.warning("%s", said[1])

    def _statuses(self, ranks: list[int]) -> dict[int, Status | None]:
        """The statuses of a few ranks, read directly (the digest names them)."""
        values = self.store.multi_get([f"status/{r}" for r in ranks]) if ranks else []
        return {r: Status.loads(v) if v else None for r, v in zip(ranks, values)}

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._pause():
            if not dist.is_initialized():
                return  # the process group was destroyed: the job is over
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the store is gone or broken: never crash the thread
                self._store_failed(exc)

    def _pause(self) -> bool:
        """Wait a tick (True: stopped). The frame of a collective the main thread was seen in is held for its
        identity, and with it the locals of every caller (a model the script has since dropped, a buffer made
        for the call): it is let go as soon as the main thread has left it, looked for every HELD_FRAME_LOOK_S."""
        end = time.monotonic() + self.tick
        while (held := self.collective) is not None:  # read once: the main thread may drop it meanwhile
            if self.stop.wait(min(HELD_FRAME_LOOK_S, max(0.0, end - time.monotonic()))):
                return True
            if self.collective is held and not self._still_in(held[0]):
                self.collective = None
            if time.monotonic() >= end:
                return False
        return self.stop.wait(max(0.0, end - time.monotonic()))

    def _still_in(self, api: Any) -> bool:
        """Whether the main thread's stack still holds frame ``api``."""
        frame = sys._current_frames().get(self.ident)
        while frame is not None and frame is not api:
            frame = frame.f_back
        return frame is not None

    def _tick(self) -> None:
        """Publish this rank's status, read the verdict and the digest (two requests); the reader also reads every
        status and writes the digest (two more)."""
        self._observe(time.monotonic())
        self.publish()
        self.look()
        if self._reads():
            self._read()
        said = self.digest.say.get(self.rank) if self.digest is not None else None
        if said is not None:
            self._say(said)

    def _in_collective(self) -> bool:
        """The main thread waits for the other ranks (not merely at the end of its script), as this tick observed
        it: read from the status, not from ``record.wait`` again, which the main thread may have left since (at
        the end of its script, once the other ranks arrived: the status would then be judged as a collective,
        and a rank that arrived as one that will never join it)."""
        return self.status.wait is not None and self.status.wait != AT_THE_END

    def _store_failed(self, exc: Exception) -> None:
        """The store stopped answering: its host is gone. Waiting in a collective, that is the error; otherwise
        stop watching quietly (at a normal end the host may leave first; every further try would only make
        torch log the socket error again)."""
        self.store_lost = _first_line(exc)
        log.debug("watchdog: the rendezvous store failed: %s", exc)
        if self._in_collective():
            message = self._store_host_gone(self.status.wait or "a collective")
            self.report(message)
            _exit(message)
        self.stop.set()

    def keep_books(self, op: Callable[[], Any]) -> Any:
        """Bookkeeping in the store beside the heartbeat (a loader's epochs, a parameter server's lost worker):
        its result, or None where the store is gone with its host, rank 0. Nothing is raised for that here: the next collective
        or request names the lost rank in its own words (the parameter server's, the gradient sync's; with
        ``store_lost`` set, a collective's says the store went with rank 0), where a socket error from this
        bookkeeping would have said only that some rank was gone while this one waits in a collective."""
        if self.store_lost is not None:
            return None
        try:
            return op()
        except RuntimeError as exc:
            if not is_peer_lost(exc):
                raise
            self.store_lost = _first_line(exc)
            log.debug("watchdog: the rendezvous store failed: %s", exc)
            return None

    def _store_host_gone(self, where: str) -> str:
        return (f"rank 0 is gone (the rendezvous store its process hosts stopped answering: {self.store_lost}) "
                f"while rank {self.rank} waits in {where}")

    # -- stopping every rank -----------------------------------------------------------------------
    def report(self, message: str) -> bool:
        """Print ``message`` once per process (the thread and the main thread may both want to)."""
        with self.report_lock:
            if self.reported:
                return False
            self.reported = True
        log.error("%s", message)
        return True

    def decide(self, message: str) -> None:
        """This rank found the error: make it everyone's, print it, leave (:meth:`leave`)."""
        first = self.store.compare_set("verdict", "", f"{self.rank}\n{message}").decode()
        decider, _, found = first.partition("\n")
        if decider != str(self.rank):
            self.obey(first)
        self._decided(found)

    def act_on(self, verdict: str) -> None:
        """A verdict in the store: this rank's own (the reader found it for this rank: printed here as found
        here), or another rank's (:meth:`obey`)."""
        decider, _, message = verdict.partition("\n")
        if decider == str(self.rank):
            if not self.leaving:
                self._decided(message)
            return
        self.obey(verdict)

    def _decided(self, message: str) -> None:
        self.leaving = True
        ending.record_error(message.splitlines()[0], verdict=True)  # now: the launcher may stop this rank soon
        self.report(message)
        record.state = "stopped"
        self._observe(time.monotonic())
        self.publish()
        self.leave(decided=True)

    def obey(self, verdict: str) -> None:
        """Another rank found the error: one line here, then leave (:meth:`leave`)."""
        decider, _, message = verdict.partition("\n")
        if decider == str(self.rank):
            return  # this rank's own verdict: its watchdog thread prints it and leaves
        self.leaving = True
        line = f"stopped because rank {decider} found: {message.splitlines()[0]}"
        self.report(line)
        self.leave(line)

    def leave(self, line: str | None = None, decided: bool = False) -> None:
        """Stopped by a verdict: acknowledge it and exit. The store lives in rank 0's process, and a rank that
        uses it after rank 0 left would print torch's socket warnings; so each other rank's last use is a
        goodbye, which rank 0 waits for before it exits (a few ticks at most). The rank that ``decided``
        waits for the others' acknowledgements first, so that each prints its line before the launcher stops it."""
        self.leaving = True
        try:
            self.store.set(f"ack/{self.rank}", "1")
            if self.rank == 0:
                self._wait_for("bye", 6 * self.tick)
            else:
                if decided:
                    self._wait_for("ack", 3 * self.tick)
                self.store.set(f"bye/{self.rank}", "1")
        except Exception as exc:  # noqa: BLE001 - the store went with its host: leave all the same
            log.debug("watchdog: leaving: %s", exc)
        _exit(line)

    def _wait_for(self, word: str, seconds: float) -> None:
        """Until every other rank still alive (as the last digest has them) has set its key ``word`` (``seconds``
        at most: where more ranks left than the digest names, for all of it); one request a look, whatever the
        number of ranks."""
        digest = self.digest
        lost = set(digest.lost or ()) | set(digest.left) if digest is not None else set()
        keys = [f"{word}/{r}" for r in range(self.size) if r != self.rank and r not in lost]
        deadline = time.monotonic() + seconds
        while keys and time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.05)

    # -- a collective that failed ------------------------------------------------------------------
    def failed_wait(self, where: str, exc: BaseException) -> None:
        """A collective marked :class:`~autodist.runtime.position.waiting` failed: a lost peer is named. Where a
        verdict already stops this rank (the peer left on it), the thread that acts on it ends the process."""
        if self.leaving:
            time.sleep(10 * self.tick + 5)  # the watchdog thread exits meanwhile; touching the store would warn
        if is_peer_lost(exc) and not isinstance(exc, PeerFailure):
            raise PeerFailure(self.explain_lost_peer(where, exc)) from None

    def explain_lost_peer(self, where: str, exc: BaseException) -> str:
        """Why a collective failed with a socket error: the peer that published its failure, or that fell silent."""
        if self.store_lost is not None:
            return self._store_host_gone(where)
        try:
            deadline = time.monotonic() + (2.5 if self.reader is not None else 3.5) * self.tick  # a digest lags a tick
            while True:
                gone, silent = self._lost_peers()
                if gone:
                    rank, what = min(gone.items())
                    return f"rank {rank} {what} while rank {self.rank} waits in {where}"
                if silent or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        except Exception as store_exc:  # noqa: BLE001 - the store went with its host
            self.store_lost = _first_line(store_exc)
            return self._store_host_gone(where)
        if not silent and isinstance(exc, PeerGone):  # its process is gone (the fence saw it), no status says why
            silent = [exc.rank]  # (a busy machine may not have let its status fall silent yet)
        if silent:
            names = ", ".join(f"rank {r}" for r in silent)
            return (f"{names} died without a word (killed by a signal, out of memory, or aborted in C++: see its "
                    f"own output) while rank {self.rank} waits in {where}")
        return f"a rank closed its connection while rank {self.rank} waits in {where}: {_first_line(exc)}"

    def _lost_peers(self) -> tuple[dict[int, str], list[int]]:
        """The other ranks that failed, ended or were stopped (where each is, in words), and those silent for
        1.5 ticks: from every status where this rank reads them, else from the digest (read again here)."""
        reader = self.reader
        if reader is not None:
            statuses, silent = reader.read(self.status)
            named, quiet = gone(statuses), [r for r, s in sorted(silent.items()) if s >= 1.5 * self.tick]
        else:
            text = self.store.multi_get(["digest"])[0]
            digest = Digest.loads(text) if text else None
            named, quiet = (digest.gone, list(digest.silent)) if digest is not None else ({}, [])
        return {r: w for r, w in named.items() if r != self.rank}, [r for r in quiet if r != self.rank]

    def excepthook(self, previous: Any, exc_type: type, exc: BaseException, tb: Any) -> None:
        """An uncaught exception: a lost peer is named in one line; any other is published, then printed."""
        if self.reported:
            return
        if is_peer_lost(exc):
            message = str(exc) if isinstance(exc, PeerFailure) else \
                self.explain_lost_peer(_collective_in_traceback(tb), exc)
            record.state, record.note = "failed", f"lost a peer: {message}"
            self._publish_quietly()
            if self.report(message) and log.isEnabledFor(10):  # DEBUG: the original traceback too
                previous(exc_type, exc, tb)
            return
        record.state, record.note = "failed", _first_line(exc, exc_type)
        self._publish_quietly()
        previous(exc_type, exc, tb)
        if self.rank == 0 and self.store_lost is None:  # the store lives here: the others stop through it first
            try:
                self._wait_for("bye", 6 * self.tick)
            except Exception:  # noqa: BLE001 - nothing more to do if the store is gone
                pass

    def _publish_quietly(self) -> None:
        if self.store_lost is not None:
            return
        try:
            self._observe(time.monotonic())
            self.publish()
        except Exception:  # noqa: BLE001 - nothing more to say if the store is gone
            pass

    # -- a normal end: the meeting of :mod:`autodist.runtime.ending` -----------------------------------
    def arrive(self) -> None:
        """Every rank ends together: wait here until all ranks ended (or one failed, or a verdict came). Each
        rank counts itself in; one request a look, whatever the number of ranks: the count, the verdict, and the
        digest, which says when the ranks not counted failed or fell silent. Every 50 ms for four ticks (a verdict
        that this rank's end causes comes within two), then once a tick."""
        try:
            if record.state != "running" or not dist.is_initialized() or self.store_lost is not None:
                return
            record.state = "exited"
            self._observe(time.monotonic())
            self.publish()
            self.store.add("arrived", 1)
            start = time.monotonic()
            with waiting("exit"):
                while not self.stop.is_set():
                    verdict, text, arrived, left = self.store.multi_get(["verdict", "digest", "arrived", "left_count"])
                    if verdict:  # another rank waits for this one in vain: not a normal end
                        self.obey(verdict.decode())
                    if int(arrived) >= self.size - int(left) or text and Digest.loads(text).ended:
                        return
                    time.sleep(0.05 if time.monotonic() - start < 4 * self.tick else self.tick)
        except Exception as exc:  # noqa: BLE001 - the store went away: nothing left to coordinate
            log.debug("watchdog: at exit: %s", exc)
        finally:
            self.halt()

    def halt(self) -> None:
        """Stop the thread and wait for it to leave the store request it may be in (see
        :func:`autodist.runtime.ending.stop_at_exit`)."""
        self.stop.set()
        ending.join_thread(self.thread)

    def _unfinished(self) -> tuple[Digest | None, dict[int, Status | None]]:
        """The digest read now, and the statuses of the lowest ranks it names as not at the end of their script."""
        text = self.store.multi_get(["digest"])[0]
        digest = Digest.loads(text) if text else None
        ranks = [r for r in (digest.unfinished if digest is not None else range(self.size)) if r != self.rank]
        return digest, self._statuses(ranks[:NAMED])

    def busy_line(self, waited: float) -> str | None:
        """At the end of the script, ``waited`` seconds after this rank arrived: where the ranks still running
        are, if every one is alive in its own code and ``busy`` has not passed (the end then waits on), else None;
        "" to wait on without a line: where every rank has arrived meanwhile (the meeting ends by itself), or
        where a lower rank that arrived prints the line."""
        digest, peers = self._unfinished()
        peers = {r: s for r, s in peers.items() if s is None or s.state != "exited"}
        if not peers:
            return ""
        if waited >= self.busy:
            return None
        me = Status(rank=self.rank, wait="the meeting at the end of its script", wait_s=waited)
        busy = in_own_code(me, peers, digest.silent if digest is not None else {}, self.timeout)
        if not busy:
            return None
        lower = digest is not None and digest.first_ended is not None and digest.first_ended < self.rank
        return "" if lower else still_waiting(me, peers, busy, self.busy_words)  # the lowest arrived rank says it

    def missing(self) -> str:
        """The ranks still running, and where each is (the lowest ones, at most NAMED); "" where every rank has
        arrived by now."""
        arrived, left = self.store.multi_get(["arrived", "left_count"])
        if int(arrived) >= self.size - int(left):  # what arrive() waits for: it returns at its next look
            return ""
        digest, peers = self._unfinished()
        if peers and all(s is not None and s.state == "exited" for s in peers.values()):
            return ""  # they said so, and count themselves in next
        late = [f"rank {r} {where_is(s)}" if s is not None else f"rank {r} never reported its progress"
                for r, s in sorted(peers.items()) if s is None or s.state == "running"]
        more = digest.unfinished_count - len(digest.unfinished) if digest is not None else 0
        if late and more > 0:
            late.append(f"and {more} more ranks")
        return "; ".join(late) if late else "the other ranks did not arrive"

    def give_up(self, message: str) -> None:
        """The end took too long: stop every rank with ``message`` (the stalled ones read it within a tick)."""
        self.decide(message)


def _collective_in_traceback(tb: Any) -> str:
    """The torch.distributed call an exception came out of, in words (for an error raised outside autodist)."""
    frames = [f for f, _ in traceback.walk_tb(tb)]
    for i, frame in enumerate(frames):
        if _in_torch_distributed(frame):
            return _main_frame_in_collective(frames[-1])[1] if _in_torch_distributed(frames[-1]) else \
                f"torch.distributed.{frame.f_code.co_name}"
        if i == len(frames) - 1:
            break
    return "a collective"


def _first_line(exc: BaseException, exc_type: type | None = None) -> str:
    lines = traceback.format_exception_only(exc_type or type(exc), exc)
    return (lines[-1] if lines else repr(exc)).strip().splitlines()[0][:300]


def _exit(verdict: str | None = None) -> None:
    """Leave now with status 1: the main thread may be blocked inside a collective that never returns."""
    ending.leave(_EXIT_CODE, verdict)


_watchdog: Watchdog | None = None


def start(rank: int, size: int, timeout: float, busy: float | None = None) -> Watchdog | None:
    """Start this rank's watchdog (idempotent); every rank of the default process group must start it.

    Args:
        rank / size: this rank and the world size of the default process group.
        timeout: seconds a rank may wait in a collective for the others before every rank stops.
        busy: seconds it waits for ranks that are alive and in their own code (None: ``timeout``); kept
            inside the process group's own timeout, which would otherwise end the wait first.

    Returns:
        The watchdog, or None in a world of one (nothing can hang).
    """
    global _watchdog
    if _watchdog is not None or size < 2 or not dist.is_initialized():
        return _watchdog
    if not timeout > 0:
        raise ValueError(f"the watchdog's timeout must be a positive number of seconds, got {timeout!r}")
    busy, words = _busy_limit(float(timeout), busy)
    store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
    _watchdog = dog = Watchdog(store, rank, size, float(timeout), threading.get_ident(), busy, words)
    previous = sys.excepthook
    sys.excepthook = lambda *args: dog.excepthook(previous, *args)
    ending.use_meeting(dog)  # at exit the ranks meet through the watchdog, which also sees failed ranks
    ending.stop_at_exit(dog.halt)  # a rank dying of an error meets nobody: its watchdog stops at the very end
    position.on_failure(dog.failed_wait)
    dog._observe(time.monotonic())
    dog.publish()
    for key in ("verdict", "digest"):  # each read with the other in one request a tick: both must exist
        store.compare_set(key, "", "")
    for key in ("arrived", "left_count"):
        store.add(key, 0)
    dog.thread.start()
    return dog


def _busy_limit(timeout: float, busy: float | None) -> tuple[float, str]:
    """How long ranks alive in their own code are waited for, and that in words: ``busy``, or less where the
    default process group's timeout (torch.distributed.init_process_group's, 10 minutes for NCCL by
    default) would end the collective before; then the words say why."""
    busy = timeout if busy is None else busy
    words = f"AUTODIST_BUSY_TIMEOUT={busy:g} s"
    group = collective_timeout()
    if group is not None and busy > group - timeout:
        allowed = max(timeout, group - timeout)
        words = (f"{allowed:g} s (AUTODIST_BUSY_TIMEOUT={busy:g} s, cut to the process group's timeout of "
                 f"{group:g} s less AUTODIST_TIMEOUT: give init_process_group a longer timeout to wait longer)")
        busy = allowed
    return busy, words


def running() -> Watchdog | None:
    """The watchdog of this process, if one was started."""
    return _watchdog


def rank_left(rank: int, why: str) -> None:
    """A mode that goes on without a lost worker (the parameter server) tells every rank's watchdog that
    ``rank`` left the job: from now on no rank waits for it, at the end or in a collective."""
    dog = _watchdog
    if dog is not None:
        dog.keep_books(lambda: (dog.store.set(f"left/{rank}", why), dog.store.add("left_count", 1)))


_data_end_listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()


def on_data_end(listener: Any) -> None:
    """Call ``listener.data_ended()`` whenever a pass over a sharded loader ends on this rank (held weakly):
    the parameter-server modes give the model the servers' parameters there."""
    _data_end_listeners.add(listener)


# -- the loader's epochs -----------------------------------------------------------------------------

def _epoch_key(loader: str, epoch: int) -> str:
    """Two keys a loader, whatever its epochs (an evaluation loader run every K steps has many): epoch E uses
    slot E mod 2, and its value names E, so that ranks one epoch apart do not mix theirs."""
    return f"epoch/{loader}/{epoch % 2}"


def epoch_begins(loader: str, epoch: int, steps: int, samples: int) -> None:
    """A sharded loader starts an epoch of ``steps`` batches: tell the other ranks (once an epoch), as the
    longest epoch any rank has: a key per loader and epoch parity, raised by compare-and-set, a few requests
    whatever the ranks."""
    dog = _watchdog
    if dog is not None:
        dog.keep_books(lambda: _raise_to(dog.store, _epoch_key(loader, epoch), epoch, steps, dog.rank, samples))


def _raise_to(store: Any, key: str, epoch: int, steps: int, rank: int, samples: int) -> None:
    """Key ``key`` holds the most steps any rank has in epoch ``epoch`` (the lowest such rank, and its samples);
    a value of an earlier epoch is replaced, one of a later epoch (this rank is behind) left."""
    mine, seen = f"{epoch} {steps} {rank} {samples}", ""
    while True:
        now = store.compare_set(key, seen, mine).decode()
        if now == mine:
            return
        if now:
            their_epoch, their_steps, their_rank, _ = map(int, now.split())
            if their_epoch > epoch or their_epoch == epoch and (their_steps, -their_rank) >= (steps, -rank):
                return
        seen = now


def data_ended(loader: str, epoch: int, steps: int, samples: int) -> None:
    """This rank's epoch ended after ``steps`` batches: raise if another rank's has more (it would wait forever)."""
    record.data_end = (epoch, steps)
    record.progress += 1
    for listener in list(_data_end_listeners):
        listener.data_ended()
    dog = _watchdog
    if dog is None:
        return
    key = _epoch_key(loader, epoch)
    most = dog.keep_books(lambda: dog.store.get(key) if dog.store.check([key]) else b"")
    if most:
        their_epoch, their_steps, rank, their_samples = map(int, most.decode().split())
        if their_epoch == epoch and their_steps > steps and rank != dog.rank:
            raise ValueError(
                f"rank {dog.rank}'s data ended after batch {steps} of epoch {epoch}, but rank {rank}'s has "
                f"{their_steps} batches (its DataLoader's dataset holds {their_samples} samples, this rank's "
                f"{samples}), so rank {rank} would wait forever in the gradient sync of batch {steps + 1}: every "
                f"rank must pass the same data to autodist.parallelize, which splits it between them")
