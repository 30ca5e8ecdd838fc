"""``autodist run`` under the hood: torchrun as a child process, and the failed rank named once at the end.

Three processes take part, each a function here:

* :func:`supervise` (the ``autodist run`` process, which loads nothing of
  torch) starts the launcher in a process group of its own, turns Ctrl-C /
  SIGTERM / SIGHUP into one SIGTERM for it (its ranks die quietly instead of
  each printing a KeyboardInterrupt traceback), and when the job failed prints
  :func:`summary` after the launcher's output;
* :func:`launch` (the launcher, which reads ``run``'s arguments first: a bad
  one is its one line and status 2) is torchrun's ``run``; what torchrun raises
  when ranks fail is written to a report file instead of a traceback; the
  ranks' lines it tails come out labelled with their rank, those of the ranks
  shown only (:mod:`autodist.cli.output`);
* :func:`run_script` (each rank) runs the user's script as ``python script.py``
  would, and records an uncaught exception's last line in the error file
  torchrun gives every rank (``TORCHELASTIC_ERROR_FILE``).

Example:
    >>> code = supervise(["-n", "2", "--show-ranks", "0", "train.py"], tempfile.mkdtemp())
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from autodist.cli.output import LABELLED, TEMPLATE, Output, RankLines

# Errors a rank gets because another rank died first: never the root cause when a rank has another one.
_PEER_GONE = ("peerfailure", "connection reset by peer", "connection closed by peer", "broken pipe",
              "connection refused", "socket closed", "recv failed", "send failed")
_LINE_MAX = 400
_kept_alive: list = []


@dataclass(frozen=True)
class Failure:
    """One rank that ended badly, as the launcher saw it."""

    rank: int
    exitcode: int  # negative: killed by that signal
    error: str | None  # the last line of its traceback, when it raised
    time: float  # when it raised, or when the launcher noticed it had died
    verdict: bool = False  # the error is autodist's watchdog stopping every rank: its words name the culprit

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"

    @property
    def secondary(self) -> bool:
        """Whether it likely died of another rank's death (its peer vanished, or the launcher stopped it)."""
        if self.exitcode == -signal.SIGTERM and self.error is None:
            return True
        return self.error is not None and any(p in self.error.lower() for p in _PEER_GONE)

    @property
    def obeyed(self) -> bool:
        """Whether it is a rank stopped by another rank's watchdog verdict (that rank's words say more)."""
        return self.error is not None and self.error.startswith("stopped because ")

    @property
    def status(self) -> int:
        """The exit status a shell gives a process that ended this way."""
        return self.exitcode if self.exitcode > 0 else 128 - self.exitcode


def python_command(command: str, *, unbuffered: bool = False) -> list[str]:
    """``python ... COMMAND`` running ``autodist COMMAND``, found where this autodist is.

    Not ``python -m autodist``: that puts the current folder first on sys.path,
    where a file named like a module torch imports (``timeit.py``) would shadow it.

    Example:
        >>> python_command("_rank")[-1]
        '_rank'
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds autodist/cli/
    code = f"import sys; sys.path[0] = {root!r}; from autodist.cli.command import main; sys.exit(main())"
    return [sys.executable, *(["-u"] if unbuffered else []), "-c", code, command]


# -- each rank -------------------------------------------------------------------------------------

def _one_line(error: BaseException) -> str:
    line = " ".join(part.strip() for part in traceback.format_exception_only(type(error), error) if part.strip())
    return line if len(line) <= _LINE_MAX else line[:_LINE_MAX - 3] + "..."


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's own first frame on, as ``python script.py`` prints it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def _record(error: BaseException, tb: TracebackType | None, error_file: str | None) -> None:
    """Write the error where torchrun looks for it (its own format, plus the exact time and last line)."""
    from autodist.runtime import ending  # in the rank, which has torch loaded already

    ending.record_error(_one_line(error), "".join(traceback.format_exception(type(error), error, tb)),
                        path=error_file)


class _LastLine:
    """The script's stderr, remembering the last line written to it: what a script that exits with an error
    status said last (argparse's ``error: unrecognized arguments``), for the launcher's summary."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.last = stream, ""

    def write(self, text: str) -> int:
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            self.last = lines[-1].strip()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stay_on_loopback() -> tuple[object, object] | None:
    """Keep a one-machine job's sockets on 127.0.0.1: the ranks' store, and gloo's (NCCL's) connections.

    ``init_process_group`` would start the store in rank 0 listening on every
    interface: rank 0 hosts it here on a socket bound to loopback, and torch's
    agent-store mode makes every rank (this one too) a client of it. gloo binds
    to the address the host name resolves to unless told an interface.
    """
    import socket

    import torch.distributed as dist

    from autodist.runtime.environment import detect_launch, elastic

    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback)  # a choice of the user's stands
    launch = detect_launch(os.environ)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if launch.rank != 0 or launch.master_port is None or elastic():  # --elastic: the launcher hosts it
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(launch.master_port)))
    listener.listen(socket.SOMAXCONN)
    store = dist.TCPStore("127.0.0.1", int(launch.master_port), is_master=True, wait_for_workers=False,
                          multi_tenant=True, master_listen_fd=listener.fileno())
    return store, listener


def interface_reaching(host: str) -> str | None:
    """The name of the network interface this machine uses to reach ``host`` (None if none is found).

    A UDP socket "connected" to the host sends nothing but picks the route; the interface holding the
    source address it chose is the one gloo must bind, which the host name's own address often is not
    (it resolves to 127.0.1.1 on many Linux machines).

    Example:
        >>> interface_reaching("127.0.0.1")
        'lo'
    """
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            source = probe.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(query.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on this interface
                if socket.inet_ntoa(packed[20:24]) == source:
                    return name
    except OSError:
        return None
    return None


def _reach_the_other_hosts() -> None:
    """A multi-node job's gloo connections go out through the interface that reaches the rendezvous host."""
    master = os.environ.get("MASTER_ADDR")
    if master and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_reaching(master)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as ``python script.py args`` would, in this process.

    An exception that escapes the script is printed as Python prints it (no
    frames of this wrapper), recorded for the launcher's summary, and the
    process exits with status 1, as Python's would. With ``--loopback-store``
    first, the job's sockets stay on 127.0.0.1 (see :func:`_stay_on_loopback`).
    """
    if argv[0] == "--loopback-store":
        argv = argv[1:]
        _kept_alive.append(_stay_on_loopback())  # the store lives as long as the rank
    else:
        _reach_the_other_hosts()
    from autodist.runtime import ending

    atexit.register(ending.end_a_group_left_alive)  # first registered, last run: after autodist's own end
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # `python script.py` puts the script's folder first
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    sys.stderr = tail = _LastLine(sys.stderr)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):  # sys.exit("why"), or argparse's error, whose line went to stderr
            line = stop.code if isinstance(stop.code, str) else tail.last
            if line:  # with the status: the launcher may stop this rank while it exits (see failure_of)
                ending.record_error(line, line, path=error_file, status=stop.code if isinstance(stop.code, int) else 1)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - reported exactly as an uncaught error would be
        tb = _user_frames(error.__traceback__)
        error.__traceback__ = tb  # what the interpreter's hook prints
        _record(error, tb, error_file)
        # What the interpreter does with an uncaught error: autodist's exit handler reads sys.last_value
        # to know that this rank is dying (its peers must not be waited for).
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
        sys.excepthook(type(error), error, tb)
        sys.exit(1)


# -- the launcher ----------------------------------------------------------------------------------

def failure_of(rank: int, failure) -> Failure:
    line, when, exitcode, verdict = None, float(failure.timestamp), failure.exitcode, False
    try:
        with open(failure.error_file) as f:
            data = json.load(f)
        ours = data.get("autodist") or {}
        line, when, verdict = ours.get("line"), float(ours.get("time", when)), bool(ours.get("verdict"))
        if line is not None and exitcode == -signal.SIGTERM:
            exitcode = int(ours.get("status", 1))  # it ended, and the launcher stopped it while it was exiting
        if line is None:  # a script that records its own errors (torch's @record): the message is the line
            message = data.get("message")
            line = message.get("message") if isinstance(message, dict) else message
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # no error file: the rank was killed, or exited without raising
    return Failure(rank, exitcode, line, when, verdict)


def _quiet_shutdown(record: logging.LogRecord) -> bool:
    """Drop torchrun's lines about stopping ranks: the summary (or the Ctrl-C line) says it once."""
    return not str(record.msg).startswith(("Received %s death signal", "Sending process %s closing signal"))


def launch(report: str, torchrun_argv: list[str], output: Output = LABELLED, world: int | None = None) -> int:
    """torchrun's ``run`` with ``torchrun_argv``; failed ranks go to the JSON file ``report``, with ``world``, the
    number of ranks where this machine's options tell it, for the summary.

    With ``output`` labelled, the ranks' lines that torchrun tails (``--tee``) carry their global rank, and
    only the ranks ``output`` shows are printed (see :mod:`autodist.cli.output`).

    Returns:
        0 when every rank finished, 1 when ranks failed (see ``report``), 128 +
        the signal when the launcher was stopped by one.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_quiet_shutdown)
    # torchrun's own lines (its OMP_NUM_THREADS banner) as `torchrun` prints them: bare, not in torch's log format.
    own = logging.getLogger("torch.distributed.run")
    own.propagate = False
    own.addHandler(logging.StreamHandler())
    if output.labelled:
        os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = TEMPLATE  # read by torchrun's run()
        # torchrun's tailing threads write to the sys.stdout and sys.stderr they find when the ranks start.
        sys.stdout, sys.stderr = RankLines(sys.stdout, output.shown), RankLines(sys.stderr, output.shown)
    try:
        run(parse_args(torchrun_argv))
        _finish_lines()
    except ChildFailedError as failed:
        _finish_lines()
        failures = [failure_of(rank, f) for rank, f in sorted(failed.failures.items())]
        if isinstance(sys.stderr, RankLines):
            sys.stderr.show_kept(root_cause(failures).rank)  # a hidden rank's crash, before the summary
        with open(report, "w") as f:
            json.dump({"world": world, "failures": [vars(failure) for failure in failures]}, f)
        return 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    except Exception as error:  # noqa: BLE001 - a rendezvous or configuration error of torchrun: one line
        print(f"autodist run: torchrun failed before the ranks ran: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


def _finish_lines() -> None:
    """The ranks are done: lines they left without a newline go out."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, RankLines):
            stream.finish()


# -- autodist run ----------------------------------------------------------------------------------

def root_cause(failures: list[Failure]) -> Failure:
    """The failure the others most likely follow from: a rank's own error or a kill before a vanished
    peer's error or a bare exit status (what a rank stopped by autodist's watchdog leaves), then the first."""
    return min(failures, key=lambda f: (f.secondary, f.verdict, f.obeyed, f.error is None and f.exitcode > 0, f.time))


def summary(failures: list[Failure], world: int | None = None) -> list[str]:
    """The lines printed after the launcher's output: the failed rank, how it ended, its error's last line.

    Example:
        >>> summary([Failure(1, 1, "ValueError: bad batch", 0.0)], world=2)
        ['autodist run: rank 1 of 2 failed (exit code 1): ValueError: bad batch']
    """
    root = root_cause(failures)
    of = f" of {world}" if world else ""
    if root.verdict and root.error:  # no rank raised: the watchdog's words (the deciding rank's) say who did what
        return [f"autodist run: the ranks were stopped: {root.error.removeprefix('stopped because ')}"]
    # Only ranks that lost a peer (on this node): the line they died with names the peer and why.
    verb = "stopped" if root.secondary else "failed"
    error = root.error.removeprefix("autodist.faults.watchdog.PeerFailure: ") if root.error else None
    lines = [f"autodist run: rank {root.rank}{of} {verb} ({root.how}){': ' + error if error else ''}"]
    # Ranks that died of the first one's death (peer gone, stopped by the launcher or by the watchdog,
    # which exit without an error of their own) are not named again.
    also = [f for f in failures if f is not root and f.error is not None and not f.secondary and not f.verdict]
    lines += [f"autodist run: rank {f.rank} also failed ({f.how}){': ' + f.error if f.error else ''}" for f in also[:3]]
    if len(also) > 3:
        lines.append(f"autodist run: and {len(also) - 3} more ranks failed")
    return lines


def _own_group_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setpgrp()  # the terminal's Ctrl-C reaches autodist run only, which stops the job in one way
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no launcher outlives autodist run
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill_now(pid: int) -> None:
    """SIGKILL the launcher and its ranks (each in a session of its own)."""
    for child in _children(pid):
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def supervise(argv: list[str], workdir: str) -> int:
    """Run the launcher as a child; forward a stop request; return the job's exit status.

    Args:
        argv: ``autodist run``'s arguments, which the launcher reads (this process loads nothing of torch).
        workdir: the run's folder (empty), where the launcher writes the failed ranks (``failures.json``).

    Returns:
        0 on success; the failed rank's exit status (128 + signal when killed); 2 for a bad argument (the
        launcher said which); 130 after Ctrl-C (143 after SIGTERM).
    """
    report = os.path.join(workdir, "failures.json")
    cmd = [*python_command("_launch"), workdir, *argv]
    child = subprocess.Popen(cmd, preexec_fn=_own_group_dying_with_parent)
    stopped_by: list[int] = []

    def stop(signum: int, _frame) -> None:
        if not stopped_by:
            print("autodist run: interrupted; stopping the ranks (again to kill them at once)", file=sys.stderr,
                  flush=True)
            child.send_signal(signal.SIGTERM)
        else:
            _kill_now(child.pid)
        stopped_by.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped_by:
        return 128 + stopped_by[0]
    if code == 1 and os.path.isfile(report):
        with open(report) as f:
            said = json.load(f)
        failures = [Failure(**entry) for entry in said["failures"]]
        if failures:
            sys.stdout.flush()
            print("\n".join(summary(failures, said["world"])), file=sys.stderr, flush=True)
            return root_cause(failures).status
    return code if code >= 0 else 128 - code

