"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-node runs.

Each host is a network namespace of its own with loopback up and one end of a
veth pair (``eth0``) holding its address: host A is 10.77.0.1/24, host B
10.77.0.2/24. A command started on a host (:meth:`Cluster.popen`, through
``ip netns exec``) sees only that host's interfaces and ports, so a 2-node
``autodist run --nnodes 2`` job across them goes through a real network stack
between two addresses, and the link between them can be slowed down with a
``tc tbf`` rate limit (``netem`` delay needs a kernel module these machines do
not have). Files are shared: both hosts see the same file system.

Every cluster's namespace names carry this process's id and a counter, so
runs side by side never collide; ports need no care at all, since each
namespace has a port space of its own. ``close()`` kills whatever still runs
on the hosts and deletes the namespaces (the veth pair goes with them); a
namespace left behind by a process that died without closing is removed by
the next :func:`make_cluster`.

Needs root and iproute2 (``ip``, ``tc``); where a namespace cannot be made,
:func:`make_cluster` raises :class:`ClusterUnavailable` saying what failed.
``python tests/cluster.py [--rate 100mbit]`` keeps a cluster up until Enter
and prints how to open a shell on each host.

Example:
    >>> with make_cluster() as cluster:
    ...     cluster.limit("100mbit")
    ...     procs = [cluster.popen(h, ["python", "-c", "print(1)"]) for h in cluster.hosts]
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Sequence

from autodist.train.checkpoint_file import process_alive

_PREFIX = "autodist-"
_SUBNET = "10.77.0"
_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no iproute2, no namespace support)."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the link, and its end of the veth pair."""

    name: str  # "A" or "B"
    netns: str
    addr: str
    dev: str = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_all(netns: str, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to every process in the namespace; the pids it was sent to."""
    pids = _pids(netns)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _delete(netns: str) -> None:
    deadline = time.monotonic() + 10
    while _kill_all(netns) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ip("netns", "del", netns, check=False)


def _remove_orphans() -> None:
    """Namespaces of earlier clusters whose process died without closing them."""
    for netns in _namespaces():
        m = re.fullmatch(rf"{_PREFIX}(\d+)-\d+-[ab]", netns)
        if m and not process_alive(int(m.group(1))):
            _delete(netns)


class Cluster:
    """Two hosts, A (node rank 0) and B, joined by one link; a context manager that deletes them on exit."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self.hosts = list(hosts)
        self.closed = False

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def popen(self, host: Host, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (``ip netns exec``: the process is ``cmd`` itself, in that namespace)."""
        return subprocess.Popen(["ip", "netns", "exec", host.netns, *cmd], **kwargs)

    def run(self, host: Host, cmd: Sequence[str], timeout: float = 60) -> str:
        """Run ``cmd`` on ``host`` to its end; its stdout (a failure raises with its stderr)."""
        proc = subprocess.run(["ip", "netns", "exec", host.netns, *cmd], capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} on host {host.name} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def limit(self, rate: str = "100mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Rate-limit the link both ways with a token bucket (``tc qdisc ... tbf``) on each end."""
        for host in self.hosts:
            proc = subprocess.run(["tc", "-n", host.netns, "qdisc", "replace", "dev", host.dev, "root", "tbf",
                                   "rate", rate, "burst", burst, "latency", latency],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise ClusterUnavailable(f"tc tbf on host {host.name} failed: {proc.stderr.strip()}")

    def kill_host(self, host: Host) -> list[int]:
        """SIGKILL every process on ``host``, as when the machine dies; the pids killed."""
        return _kill_all(host.netns)

    def pids(self, host: Host) -> list[int]:
        return _pids(host.netns)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for host in self.hosts:
            _delete(host.netns)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_cluster() -> Cluster:
    """Create hosts A (10.77.0.1) and B (10.77.0.2) joined by a veth pair.

    Raises:
        ClusterUnavailable: not root, ``ip`` missing, or the kernel refused a namespace or the link;
            the message says which step failed.
    """
    if shutil.which("ip") is None:
        raise ClusterUnavailable("`ip` (iproute2) is not installed; scripts/setup.sh installs it when run as root")
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root (this process runs as uid %d)" % os.geteuid())
    _remove_orphans()
    tag = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
    hosts = [Host("A", f"{tag}-a", f"{_SUBNET}.1"), Host("B", f"{tag}-b", f"{_SUBNET}.2")]
    cluster = Cluster(hosts)
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
        # made inside the namespaces at once: both ends may be called eth0, and nothing appears on this host
        _ip("link", "add", "eth0", "netns", hosts[0].netns, "type", "veth", "peer", "name", "eth0",
            "netns", hosts[1].netns)
        for host in hosts:
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            _ip("-n", host.netns, "link", "set", host.dev, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
    except BaseException:
        cluster.close()
        raise
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description="Keep two hosts (network namespaces) up until Enter.")
    parser.add_argument("--rate", default=None, help="tc tbf rate of the link, e.g. 100mbit (default: unlimited)")
    args = parser.parse_args()
    try:
        cluster = make_cluster()
    except ClusterUnavailable as error:
        raise SystemExit(f"cluster.py: {error}") from None
    with cluster:
        if args.rate:
            cluster.limit(args.rate)
        for host in cluster.hosts:
            print(f"host {host.name}: {host.addr} on {host.dev}; a shell there: ip netns exec {host.netns} bash")
        print(f"link: {args.rate or 'unlimited'}; autodist run picks {cluster.a.dev} on each host (GLOO_SOCKET_IFNAME)")
        try:
            input("Enter (or Ctrl-C) deletes both hosts\n")
        except (KeyboardInterrupt, EOFError):
            pass


if __name__ == "__main__":
    main()
