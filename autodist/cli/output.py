"""What the ranks print under ``autodist run``: each line whole, labelled with its rank (``[rank3]: loss 0.25``).

Under torchrun (``--tee 3``, which ``autodist run`` adds) each rank's stdout and stderr go to files in the
run's log folder, and the launcher tails them into its own stdout and stderr a line at a time, each line
prefixed by torchrun from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (:data:`TEMPLATE`: the global rank). The
files are the rank's file descriptors 1 and 2, so what C code and subprocesses print is labelled too, and
what a killed rank wrote is still read (a wrapper of ``sys.stdout`` in the rank would miss the first two and
could lose the last). With ``--keep-going`` the ranks' pipes are read here instead (:func:`relay`). Either
way the lines go through :class:`RankLines`, which prints the ranks shown and keeps the last lines of the
others, so that a hidden rank's crash can still be shown.
"""
from __future__ import annotations

import io
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

TEMPLATE = "[rank${rank}]: "  # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; label() spells the same
KEPT_LINES = 40  # of a hidden rank's stderr: enough for a traceback
# A label, and torch's own one after it (its excepthook prints "[rank1]: Traceback ...", C++ logs "[rank1]:[W"):
# the line keeps one.
_LABELLED = re.compile(r"\[rank(\d+)\]: (?:\[rank\1\]: ?)?")
# torch's C++ warnings (a TCPStore peer gone) end with the C++ backtrace of the error: dozens of frames of
# addresses, before autodist's own line that says what happened. One line stands for them.
_BACKTRACE = re.compile(r"Exception raised from \S+ at .* \(most recent call first\):\s*$")
_FRAME = re.compile(r"(frame #\d+: |<omitting python frames>)")
LEFT_OUT = "(torch's C++ backtrace of that error left out: --raw-output shows it)\n"


def label(rank: int) -> str:
    """The label of ``rank``'s lines.

    Example:
        >>> label(3) + "loss 0.25"
        '[rank3]: loss 0.25'
    """
    return f"[rank{rank}]: "


@dataclass(frozen=True)
class Output:
    """How the ranks' lines reach the terminal: labelled or raw (as the ranks write them), which ranks shown.

    ``str()`` and :meth:`parse` carry it from ``autodist run`` to its launcher: ``all``, ``raw`` or ``0,2``.
    """

    labelled: bool = True
    shown: frozenset[int] | None = None  # None: every rank

    def __post_init__(self) -> None:
        if self.shown is not None and not self.labelled:
            raise ValueError("only labelled lines can be told apart: shown ranks need labelled=True")

    def __str__(self) -> str:
        if not self.labelled:
            return "raw"
        return "all" if self.shown is None else ",".join(str(r) for r in sorted(self.shown))

    @classmethod
    def parse(cls, text: str) -> Output:
        """The Output that ``str()`` gave ``text``.

        Example:
            >>> Output.parse("0,2")
            Output(labelled=True, shown=frozenset({0, 2}))
        """
        if text in ("raw", "all"):
            return cls(labelled=text == "all")
        return cls(shown=ranks_of(text))


LABELLED = Output()  # the default: every rank's lines, labelled


def ranks_of(text: str) -> frozenset[int]:
    """The ranks of a comma-separated list ("0" or "0,3"); ValueError naming what is wrong.

    Example:
        >>> sorted(ranks_of("3,0"))
        [0, 3]
    """
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"{text!r}: give ranks as numbers separated by commas, e.g. 0 or 0,3")
    return frozenset(int(part) for part in parts)


class RankLines:
    """A stream the ranks' labelled lines are written to, each write one rank's (torchrun's tailing threads,
    one per rank, and :func:`relay` write so): a rank's line goes on to ``stream`` once whole, in one write,
    if the rank is shown; of the others the last :data:`KEPT_LINES` are kept for :meth:`show_kept`. Writes
    without a label (the launcher's own lines) go on unchanged. The C++ backtrace torch prints under some of its
    warnings (its frames of addresses) becomes one line (:data:`LEFT_OUT`).

    A write may hold part of a line: torchrun's tailing reads a rank's log file up to its end, where the rank
    may have written half a line (``print`` writes the text, then the newline), and labels the rest when it
    comes. The part waits here for the rest, so that no other rank's line lands in the middle of it.
    """

    def __init__(self, stream: Any, shown: frozenset[int] | None = None) -> None:
        self._stream, self._shown = stream, shown
        self._kept: dict[int, deque[str]] = {}
        self._partial: dict[int, str] = {}  # per rank, the start of a line whose end has not come yet
        self._in_backtrace: set[int] = set()  # ranks whose next frame lines are left out
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        found = _LABELLED.match(text)
        if found is None:
            return self._put(text)
        rank = int(found.group(1))
        with self._lock:
            rest = self._partial.pop(rank, "") + text[found.end():]
            if not rest.endswith("\n"):
                self._partial[rank] = rest
                return len(text)
        self._line(rank, label(rank) + rest)
        return len(text)

    def finish(self) -> None:
        """The ranks are done: what they left without a newline goes out as lines."""
        with self._lock:
            partial, self._partial = self._partial, {}
        for rank, rest in sorted(partial.items()):
            self._line(rank, label(rank) + rest + "\n")

    def _line(self, rank: int, line: str) -> None:
        body = line[len(label(rank)):]
        if rank in self._in_backtrace:
            if _FRAME.match(body):
                return
            self._in_backtrace.discard(rank)
        if _BACKTRACE.match(body):
            self._in_backtrace.add(rank)
            line = label(rank) + LEFT_OUT
        if self._shown is not None and rank not in self._shown:
            with self._lock:
                self._kept.setdefault(rank, deque(maxlen=KEPT_LINES)).append(line)
            return
        self._put(line)

    def _put(self, text: str) -> int:
        written = self._stream.write(text)
        if text.endswith("\n"):
            self._stream.flush()  # a line as soon as it is whole, into a pipe or a file too
        return written

    def show_kept(self, rank: int) -> None:
        """Print the last lines kept of hidden ``rank`` (it failed: the failure summary follows them)."""
        self.finish()
        with self._lock:
            kept = self._kept.pop(rank, ())
        for line in kept:
            self._stream.write(line if line.endswith("\n") else line + "\n")
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def relay(pipe: IO[bytes], rank: int, lines: RankLines) -> threading.Thread:
    """Copy what ``rank`` writes to ``pipe`` into ``lines``, a labelled line at a time, in a thread (started).

    A line is copied once whole (or at the end of the pipe); a carriage return ends a line too, as in
    torchrun's tailing (a progress bar's updates come out as lines).
    """
    def copy() -> None:
        with io.TextIOWrapper(pipe, encoding="utf-8", errors="replace") as text:
            for line in text:
                lines.write(label(rank) + (line if line.endswith("\n") else line + "\n"))

    thread = threading.Thread(target=copy, name=f"autodist-relay-{rank}", daemon=True)
    thread.start()
    return thread
