"""Jobs across two hosts: `autodist run --nnodes 2` in two network namespaces joined by a veth pair.

Host A (10.77.0.1, node rank 0) hosts the rendezvous; host B (10.77.0.2) joins it. Each test makes a cluster of
its own (tests/cluster.py) and deletes it at the end; without root or iproute2 the tests skip, saying why.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.testing import assert_close

import two_hosts_train
from cluster import Cluster, ClusterUnavailable, make_cluster

pytestmark = pytest.mark.slow  # jobs through the real launcher: the full tier

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers
SCRIPT = os.path.join(HERE, "two_hosts_train.py")
TIMEOUT = 5  # AUTODIST_TIMEOUT: how long the watchdog lets a rank wait for one that sends no heartbeat
PORT = 29400  # each cluster's namespaces have ports of their own: a fixed one cannot collide


@pytest.fixture
def cluster():
    try:
        made = make_cluster()
    except ClusterUnavailable as error:
        pytest.skip(f"no two-host cluster on this machine: {error}")
    yield made
    made.close()


class Job:
    """One `autodist run` per host, their output collected line by line with the time each line came."""

    def __init__(self, cluster: Cluster, nproc: int, args: list[str], env: dict[str, str] | None = None,
                 elastic: bool = False) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lines: list[list[tuple[float, str]]] = []
        for node, host in enumerate(cluster.hosts):
            cmd = [sys.executable, "-m", "autodist", "run", *(["--elastic"] if elastic else []),
                   "--nnodes", str(len(cluster.hosts)),
                   "--node-rank", str(node), "--rdzv-endpoint", f"{cluster.a.addr}:{PORT}",
                   "-n", str(nproc), SCRIPT, *args]
            proc = cluster.popen(host, cmd, env=_env() | (env or {}), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            self.procs.append(proc)
            self.lines.append([])
            threading.Thread(target=self._read, args=(proc, self.lines[-1]), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, into: list) -> None:
        for line in proc.stdout:
            into.append((time.monotonic(), line))

    def output(self, node: int) -> str:
        return "".join(line for _, line in self.lines[node])

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            pytest.fail(f"the job did not end within {timeout} s:\n" + self.describe())
        time.sleep(0.1)  # the readers' last lines
        return codes

    def wait_for(self, node: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for _, line in self.lines[node]):
            if time.monotonic() > deadline or self.procs[node].poll() is not None:
                pytest.fail(f"host {node} never printed {text!r}:\n" + self.describe())
            time.sleep(0.05)

    def describe(self) -> str:
        return "\n".join(f"--- host {'AB'[n]} (exit {p.poll()}):\n{self.output(n)}" for n, p in enumerate(self.procs))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_",
                                                                      "PET_", "GLOO_"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # no GLOO_SOCKET_IFNAME: autodist run picks the interface that reaches the rendezvous host (gloo's own
    # choice, the address the host name resolves to, is loopback here)
    return env


def _namespace_inode(netns: str) -> int:
    return os.stat(f"/run/netns/{netns}").st_ino


_SINK = """import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n, start = 0, time.monotonic()
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
print(n, time.monotonic() - start)
"""
_SOURCE = "import socket, sys; socket.create_connection((sys.argv[1], 5001)).sendall(b'x' * int(sys.argv[2]))"


def _seconds_to_send(cluster: Cluster, nbytes: int) -> float:
    """Seconds host A takes to receive ``nbytes`` sent by host B over their link."""
    sink = cluster.popen(cluster.a, [sys.executable, "-c", _SINK, cluster.a.addr], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline() == "ready\n"
    cluster.run(cluster.b, [sys.executable, "-c", _SOURCE, cluster.a.addr, str(nbytes)])
    received, seconds = sink.communicate(timeout=30)[0].split()
    assert int(received) == nbytes
    return float(seconds)


def test_the_hosts_reach_each_other_and_the_rate_limit_holds(cluster):
    assert "10.77.0.2/24" in cluster.run(cluster.b, ["ip", "-brief", "addr", "show", "eth0"])
    assert _seconds_to_send(cluster, 4_000_000) < 0.5  # unlimited: memory speed (tens of Gbit/s)
    cluster.limit("100mbit")
    seconds = _seconds_to_send(cluster, 4_000_000)  # 32 Mbit: 0.32 s at 100 Mbit/s (less if accept() is late)
    assert 0.2 < seconds < 3.0, f"4 MB took {seconds:.2f} s over a 100 Mbit/s link"


def _run_exactness(cluster: Cluster, tmp_path, nproc: int, mp: int, *more: str) -> dict:
    out = tmp_path / "state.pt"
    job = Job(cluster, nproc, [str(out), "--mp", str(mp), *more])
    assert job.wait(timeout=180) == [0, 0], job.describe()
    saved = torch.load(out, weights_only=True)
    assert_close(saved["state"], two_hosts_train.reference(epochs=3), rtol=1e-5, atol=1e-6)
    hosts = [_namespace_inode(h.netns) for h in cluster.hosts]
    # rank r ran in the namespace of node r // nproc, and torchrun says the same node rank
    assert saved["ranks"] == [(r, hosts[r // nproc], r // nproc) for r in range(2 * nproc)]
    return saved


@pytest.mark.e2e
def test_data_parallel_across_two_hosts_trains_like_one_process(cluster, tmp_path):
    assert _run_exactness(cluster, tmp_path, nproc=1, mp=1)["world"] == 2


EVERY = 8  # the Hierarchical phase: local SGD between the hosts every 8 steps, 32 steps


@pytest.mark.e2e
def test_two_hosts_of_two_ranks_hybrid_exact_and_hierarchical_sends_little_over_the_link(cluster, tmp_path):
    # one job, two phases (starting the job is most of the time):
    # 1. mp groups are consecutive ranks: {0, 1} on host A, {2, 3} on host B; gradients are averaged across the
    #    link; the result is the single-process run's
    saved = _run_exactness(cluster, tmp_path, 2, 2, "--hierarchical", str(EVERY))
    assert saved["world"] == 4
    # 2. Hierarchical(across=LocalSGD(every=8)): the hosts' exact sync never crosses the link
    ranks = saved["hierarchical"]
    params = [r["params"] for r in ranks]
    assert torch.equal(params[0], params[1]) and torch.equal(params[2], params[3])  # host-mates, every step
    assert torch.equal(params[0], params[2])  # 32 steps: the hosts have just met
    assert [r["syncs"] for r in ranks] == [4] * 4
    model_bytes = ranks[0]["model_bytes"]
    for host in (0, 1):  # both ranks of a host read the same link counter
        link = ranks[2 * host]["link"]
        claimed = ranks[2 * host]["across"] + ranks[2 * host + 1]["across"]
        # one model per meeting from each host, split between its ranks (and a few numbers: the samples' weight)
        assert 4 * model_bytes <= claimed <= 4 * (model_bytes + 64), (claimed, model_bytes)
        print(f"host {'AB'[host]}: {link} bytes over the link, {claimed:.0f} claimed, a model is {model_bytes}")
        # what crossed: the meetings, plus TCP/IP headers, heartbeats and two barriers; exact sync would send at
        # least one model per step (32 here)
        assert claimed <= link < 1.5 * claimed + 50_000, (host, link, claimed)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_death_of_a_whole_host_is_named_on_the_other(cluster, tmp_path, how):
    # killed: every process on host B dies, its kernel closes their sockets (host A's sockets see the close);
    # unplugged: host B's link goes down first, so nothing reaches host A any more (a power cut, a cable pulled)
    job = Job(cluster, 1, [str(tmp_path / "never.pt"), "--epochs", "1000", "--step-sleep", "0.05"],
              env={"AUTODIST_TIMEOUT": str(TIMEOUT)})
    job.wait_for(0, "step 5", timeout=90)
    died = time.monotonic()
    if how == "unplugged":
        subprocess.run(["ip", "-n", cluster.b.netns, "link", "set", cluster.b.dev, "down"], check=True)
    assert cluster.kill_host(cluster.b), "nothing ran on host B"
    codes = job.wait(timeout=60)
    ended = job.lines[0][-1][0] - died
    print(f"host B {how}: host A's job ended {ended:.1f} s later")
    assert codes[0] == 1, job.describe()
    words = {"killed": "rank 1 died without a word", "unplugged": "rank 1 sent no heartbeat for"}[how]
    assert words in job.output(0), job.describe()
    assert ended < TIMEOUT + 10, job.describe()  # the timeout, a tick, the launcher stopping


@pytest.mark.e2e
def test_elastic_job_finishes_on_one_host_when_the_other_is_unplugged(cluster, tmp_path):
    # autodist run --elastic on both hosts, one rank each; host A's launcher hosts the store. Host B's link
    # goes down and its processes die: rank 0 gives its all-reduce up at the group's timeout, rank 1's heartbeat
    # is silent, and rank 0 finishes alone: the same training as one process
    out = tmp_path / "state.pt"
    job = Job(cluster, 1, [str(out), "--epochs", "6", "--step-sleep", "0.2"], env={"AUTODIST_TIMEOUT": str(TIMEOUT)},
              elastic=True)
    job.wait_for(0, "step 5", timeout=90)
    subprocess.run(["ip", "-n", cluster.b.netns, "link", "set", cluster.b.dev, "down"], check=True)
    assert cluster.kill_host(cluster.b), "nothing ran on host B"
    codes = job.wait(timeout=120)
    assert codes[0] == 0, job.describe()
    assert "elastic: lost rank 1" in job.output(0), job.describe()
    saved = torch.load(out, weights_only=True)
    assert_close(saved["state"], two_hosts_train.reference(epochs=6), rtol=1e-5, atol=1e-6)
