"""Parameter-server modes (Downpour, EASGD) keep their promises: real gloo ranks, real processes, real files."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.ps.layout import ShardLayout

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers


def test_layout_cuts_the_flat_vector_by_size():
    layout = ShardLayout.split((10, 3, 1, 6), servers=(0, 1, 2))
    assert layout.bounds == ((0, 6), (6, 13), (13, 20))
    assert [(p.param, p.start, p.stop, p.offset) for p in layout.pieces(1)] == [(0, 6, 10, 0), (1, 0, 3, 4)]
    with pytest.raises(ValueError, match="fewer than the 3 servers"):
        ShardLayout.split((2,), servers=(0, 1, 2))


def test_messages_carry_data_only(tmp_path):
    import io

    from autodist.ps import wire
    from autodist.ps.server import _optimizer_class

    spec = {"class": ("torch.optim.adam", "Adam"), "defaults": {"lr": 0.1, "betas": (0.9, 0.99), "foreach": None},
            "groups": [({"lr": 1e-3}, [0, 1])], "lost": {1: "why"}, "state": torch.ones(3)}
    assert str(wire.decode(wire.encode(spec))) == str(spec)
    with pytest.raises(TypeError, match=r"the optimizer's hyperparameters or state\)\['lr'\] is a "
                                        r"_RunsCodeWhenLoaded, which torch.load\(weights_only=True\) refuses"):
        wire.encode({"lr": _RunsCodeWhenLoaded(str(tmp_path / "ran"))})
    buffer = io.BytesIO()
    torch.save({"lr": _RunsCodeWhenLoaded(str(tmp_path / "ran"))}, buffer)
    with pytest.raises(wire.Refused, match="a message from rank 3 holds more than data"):
        wire.decode(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8), peer=3)
    assert not os.path.exists(tmp_path / "ran")
    assert _optimizer_class("torch.optim.adam", "Adam") is torch.optim.Adam
    for module, name in [("os", "system"), ("never_imported_module", "Opt"), ("torch.nn", "Linear")]:
        with pytest.raises(wire.Refused, match="is not a torch.optim.Optimizer this server has imported"):
            _optimizer_class(module, name)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="staleness must be an int >= 0"):
        autodist.Downpour(staleness=-1)
    with pytest.raises(ValueError, match=r"alpha must be a number in \(0, 1\)"):
        autodist.EASGD(alpha=2.0)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _one_worker(strategy, epochs=2):
    """Rank 0 trains alone (rank 1 only serves, or waits); returns rank 0's batches and final state."""
    x, y = w.digits_like(24)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=strategy)
    if w.rank() != 0:
        strategy.close()  # done at once: from here on this rank only serves (servers=2) and waits for the end
        return None
    opt = _sgd(model) if isinstance(strategy, autodist.Downpour) else torch.optim.SGD(model.parameters(), lr=0.1)
    seen, ends = [], []
    for _ in range(epochs):
        for xb, yb in data:
            seen.append((xb.clone(), yb.clone()))
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        ends.append(len(seen))
        end_of_pass = w.state(model)
    strategy.close()
    return seen, ends, end_of_pass, w.state(model), strategy.version


def _downpour_alone(servers):
    return _one_worker(autodist.Downpour(servers=servers))


@pytest.mark.parametrize("servers", [1, 2])
def test_downpour_with_one_worker_is_its_optimizer_on_its_batches(ranks, servers):
    seen, _, end_of_pass, final, version = ranks(2, _downpour_alone, servers)[0]
    ref = w.seeded(w.mlp, 0)
    opt = _sgd(ref)
    for xb, yb in seen:
        opt.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        opt.step()
    assert version == len(seen) == 6  # one server update per step
    assert_close(end_of_pass, w.state(ref), rtol=1e-5, atol=1e-6)
    assert_close(final, w.state(ref), rtol=1e-5, atol=1e-6)


def _easgd_alone():
    return _one_worker(autodist.EASGD(every=2, alpha=0.5, servers=2))


def test_easgd_center_moves_as_the_formula_says(ranks):
    seen, ends, end_of_pass, final, version = ranks(2, _easgd_alone)[0]
    ref = w.seeded(w.mlp, 0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    center = [p.detach().clone() for p in ref.parameters()]
    for i, (xb, yb) in enumerate(seen):
        opt.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        opt.step()
        with torch.no_grad():
            if (i + 1) % 2 == 0:  # every=2: e = alpha (x - c); x -= e; c += e
                for p, c in zip(ref.parameters(), center):
                    e = 0.5 * (p - c)
                    p.sub_(e)
                    c.add_(e)
            if i + 1 in ends:  # the end of a pass: the model takes the center, and goes on from it
                for p, c in zip(ref.parameters(), center):
                    p.copy_(c)
    assert version == len(seen) // 2
    expected = dict(zip([n for n, _ in ref.named_parameters()], center))
    assert_close(end_of_pass, expected, rtol=1e-5, atol=1e-6)
    assert_close(final, expected, rtol=1e-5, atol=1e-6)


def _race(staleness, slow_rank=1):
    x, y = w.digits_like(64)
    strategy = autodist.Downpour(staleness=staleness)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for xb, yb in data:
        if w.rank() == slow_rank:
            time.sleep(0.03)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    strategy.close()
    return strategy.max_lead, strategy.clock, strategy.version, w.state(model)


def test_staleness_bound_holds_the_fast_worker_back(ranks):
    bounded = ranks(2, _race, 1)
    free = ranks(2, _race, None)
    # 8 pushes each; with staleness=1 the fast rank 0 never gets more than 1 push ahead of the slow rank 1
    assert [r[1] for r in bounded] == [8, 8] and all(r[2] == 16 for r in bounded)
    assert bounded[0][0] == 1 and bounded[1][0] <= 1
    assert free[0][0] >= 4  # unbounded, it runs far ahead of the sleeping worker
    assert_close(bounded[0][3], bounded[1][3], rtol=0, atol=0)  # close() gives every rank the final model


def _checkpoint_round_trip(path):
    x, y = w.digits_like(24)
    ps = autodist.Downpour(servers=2)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=ps)
    out = None
    if w.rank() == 0:
        opt = _sgd(model)
        batches = []
        for epoch in range(2):
            for xb, yb in data:
                batches.append((xb, yb))
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
            if epoch == 0:
                ps.save(path, epoch=1)  # the servers' state after the first pass, by this rank alone
                saved = w.state(model)
        out = (saved, w.state(model), batches[3:])
    ps.close()
    # a new run: another initialization, the checkpoint loaded, the second pass replayed
    ps2 = autodist.Downpour(servers=2)
    model2, _ = autodist.parallelize(w.seeded(w.mlp, 5), None, sync=ps2)
    extra = autodist.load(path, model2)
    ps2.load_state_dict(extra["param_server"])
    if w.rank() == 0:
        opt2 = _sgd(model2)
        for xb, yb in out[2]:
            opt2.zero_grad()
            F.cross_entropy(model2(xb), yb).backward()
            opt2.step()
        ps2.pull()
        out = (*out[:2], w.state(model2), extra["epoch"])
    ps2.close()
    return out


def test_checkpoint_holds_the_servers_state_and_resumes_exactly(ranks, tmp_path):
    path = str(tmp_path / "ps.pt")
    saved, uninterrupted, resumed, epoch = ranks(2, _checkpoint_round_trip, path)[0]
    plain = w.seeded(w.mlp, 9)
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])  # loads into the plain model
    assert_close(w.state(plain), saved, rtol=0, atol=0)
    assert epoch == 1
    # the servers' momentum came back too: the resumed second pass is the uninterrupted one
    assert_close(resumed, uninterrupted, rtol=1e-6, atol=1e-7)


# -- real processes: a worker or a server killed -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(size: int, victim: int, out: str, *how: str) -> tuple[list[int], list[str], float]:
    """``size`` processes as mpirun starts them; rank ``victim`` SIGKILLs itself mid-run (``how``: "crafted",
    it sends a crafted message first and leaves; "between": as epoch 1 begins, while the others wait to
    begin it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    env |= {"PYTHONPATH": os.pathsep.join([HERE, env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
            "AUTODIST_TIMEOUT": "20"}
    port, procs = _free_port(), []
    for rank in range(size):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, str(victim), out, *how],
            env=env | {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
                       "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
                       "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    killed_at = float(open(out + ".killed").read()) if os.path.exists(out + ".killed") else float("nan")
    return [p.returncode for p in procs], outputs, time.time() - killed_at


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_worker_does_not_stop_the_others(tmp_path):
    out = str(tmp_path / "final.pt")
    codes, outputs, _ = _launch(3, 2, out)
    assert codes[2] == -signal.SIGKILL
    assert codes[:2] == [0, 0], "\n".join(outputs)
    assert "training finished with 2 of 3 workers; lost: rank 2" in outputs[0]
    final = torch.load(out, weights_only=True)
    assert final["lost"] == [2] and final["epochs"] == 3
    assert final["accuracy"] > 0.8  # the two survivors trained on: the servers' final model learned


@pytest.mark.slow
@pytest.mark.e2e
def test_a_message_that_would_run_code_is_refused_and_the_others_train_on(tmp_path):
    out = str(tmp_path / "final.pt")
    codes, outputs, _ = _launch(3, 2, out, "crafted")
    assert not os.path.exists(out + ".ran"), "the server ran the code a worker sent"
    assert codes == [0, 0, 0], "\n".join(outputs)
    assert ("parameter server: a message from rank 2 holds more than data (tensors, numbers, strings, and lists and "
            "dicts of them), so it was refused, not loaded (Trying to load unsupported GLOBAL posix.system whose "
            "module posix is blocked.); worker rank 2 is no longer served") in outputs[0], outputs[0]
    final = torch.load(out, weights_only=True)
    assert final["lost"] == [2] and final["epochs"] == 3 and final["accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_worker_under_autodist_run_keep_going(tmp_path):
    # torchrun would stop every rank when one dies; --keep-going starts the ranks without it
    out = str(tmp_path / "final.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    env |= {"PYTHONPATH": os.pathsep.join([HERE, env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
            "AUTODIST_TIMEOUT": "20"}
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "--keep-going", "-n", "3", __file__, "2", out],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "autodist run: finished with 2 of 3 ranks; lost rank 2 (killed by SIGKILL)" in proc.stderr, proc.stderr
    final = torch.load(out, weights_only=True)
    assert final["lost"] == [2] and final["epochs"] == 3 and final["accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_server_ends_the_job_with_the_last_checkpoint_intact(tmp_path):
    out = str(tmp_path / "final.pt")
    codes, outputs, seconds = _launch(3, 0, out)
    assert codes[0] == -signal.SIGKILL
    assert codes[1] != 0 and codes[2] != 0
    for text in outputs[1:]:
        assert "the parameter server on rank 0" in text and "is gone" in text and "last checkpoint" in text, text
    assert seconds < 15
    plain = w.seeded(lambda: w.mlp(classes=2), 1)
    plain.load_state_dict(torch.load(out + ".ckpt", weights_only=True)["model"])


@pytest.mark.slow
@pytest.mark.e2e
def test_a_server_killed_between_epochs_is_named_by_the_workers_that_begin_the_next(tmp_path):
    # The job's store lives in rank 0 too: the loader's bookkeeping of the new epoch finds it gone first, and
    # the workers' next request names the lost server (not a socket error "while waiting in a collective").
    out = str(tmp_path / "final.pt")
    codes, outputs, _ = _launch(3, 0, out, "between")
    assert codes[0] == -signal.SIGKILL
    for code, text in zip(codes[1:], outputs[1:]):
        assert code != 0 and "ServerLost: the parameter server on rank 0" in text and "is gone" in text, text


class _RunsCodeWhenLoaded:
    """Unpickling this runs a shell command (what a crafted message would do to a server that unpickles)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _send_crafted(ps, out: str) -> None:
    """Send server 0 a push whose blob would run code if unpickled, then leave."""
    import io

    from autodist.ps import wire

    buffer = io.BytesIO()
    torch.save({"lr": _RunsCodeWhenLoaded(out + ".ran")}, buffer)
    blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    header = torch.tensor([wire.PUSH, ps.clock + 1, 0, blob.numel()], dtype=torch.int64)
    for payload in (header, blob):
        ps.group.send([payload], 0, wire.REQUEST_TAG).wait()
    time.sleep(1)
    os._exit(0)


def _script(victim: int, out: str, how: str = "") -> None:
    """One rank of the fault tests: 3 epochs of Downpour on 3 ranks; ``victim`` dies in epoch 1 (``how``:
    "crafted", it sends a message that would run code on the server first; "between", before the epoch's
    first batch, the others beginning the epoch after it died)."""
    torch.set_num_threads(1)
    x, y = w.digits_like(96, classes=2)
    y = (x[:, 0] + x[:, 1] > 0).long()  # a learnable rule
    ps = autodist.Downpour()
    model, data = autodist.parallelize(w.seeded(lambda: w.mlp(classes=2), 0), w.loader(x, y, 12), sync=ps)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = autodist.rank()
    for epoch in range(3):
        if how == "between" and epoch == 1:
            time.sleep(0.5 if rank == victim else 2.0)
        for step, (xb, yb) in enumerate(data):
            if rank == victim and epoch == 1 and step == 2 and how == "crafted":
                _send_crafted(ps, out)
            if rank == victim and epoch == 1 and step == (0 if how == "between" else 2):
                with open(out + ".killed", "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        if rank == 0:
            ps.save(out + ".ckpt", epoch=epoch)
    ps.close()
    if rank == 0:
        with torch.no_grad():
            accuracy = float((model(x).argmax(1) == y).float().mean())
        torch.save({"lost": sorted(ps.lost), "epochs": 3, "accuracy": accuracy}, out)


if __name__ == "__main__":
    _script(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])


# -- convergence on a small real task: scikit-learn's handwritten digits ------------------------------------

def _digits_accuracy(mode: str) -> float:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, test = slice(0, 1500), slice(1500, None)
    strategy = autodist.Downpour() if mode == "downpour" else autodist.EASGD()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]), batch_size=50,
                                         shuffle=True, generator=torch.Generator().manual_seed(1))
    model, data = autodist.parallelize(net, loader, sync=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / 2, momentum=0.9)
    for _ in range(8):
        for xb, yb in data:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    strategy.close()  # every rank now holds the final model (Downpour: the servers'; EASGD: the center)
    with torch.no_grad():
        return (model(x[test]).argmax(1) == y[test]).float().mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["downpour", "easgd"])
def test_converges_on_real_digits(ranks, mode):
    accuracies = ranks(2, _digits_accuracy, mode)
    assert accuracies[0] == accuracies[1]  # one final model on every rank
    assert accuracies[0] > 0.85, accuracies  # chance is 0.1; bench_param_server.py compares with exact sync
