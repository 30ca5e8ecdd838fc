"""The watchdog: every hang and every lost rank becomes one named error on every rank, within a bounded time.

Each fault is injected for real into tests/faulty_train.py on two processes launched the way mpirun
launches them (and once through `autodist run`), with AUTODIST_TIMEOUT=5; the tests assert the message
each rank prints, their exit status and the seconds from the fault to the last exit.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import autodist
from autodist.faults.verdicts import Status, in_own_code, judge, still_waiting, where
from autodist.runtime.position import wait_words
from autodist.runtime.environment import hang_timeout

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers
SCRIPT = os.path.join(HERE, "faulty_train.py")
TIMEOUT = 5  # AUTODIST_TIMEOUT (and AUTODIST_EXIT_TIMEOUT) in these runs
BUSY = 2 * TIMEOUT  # AUTODIST_BUSY_TIMEOUT in these runs: how long a rank alive in its own code is waited for


# -- pure: what the messages say ---------------------------------------------------------------------

def test_a_rank_in_its_own_code_is_waited_for_up_to_the_busy_limit_then_named_with_its_stack():
    me = Status(rank=0, wait=wait_words("sync", 411, (2, 412, 500)), wait_s=61.0)
    stalled = Status(rank=1, syncs=411, position=[2, 412, 500], stuck_s=60.0, at="train.py:9 in main",
                     stack='  File "train.py", line 9, in main\n    time.sleep(1000)\n')
    assert judge(me, {1: stalled}, {1: 0.5}, timeout=60, settle=1, busy=1800) is None  # alive: waited for
    assert still_waiting(me, {1: stalled}, [1], "AUTODIST_BUSY_TIMEOUT=1800 s") == (
        "rank 0 has waited 61 s in the gradient sync of batch 412 of epoch 2 for rank 1, which is in its own code "
        "after batch 412 of epoch 2 (411 gradient syncs done) at train.py:9 in main, at the same Python line for 60 s: "
        "its heartbeat goes on, so it is waited for up to AUTODIST_BUSY_TIMEOUT=1800 s")
    me.wait_s = 1801.0
    assert judge(me, {1: stalled}, {1: 0.5}, timeout=60, settle=1, busy=1800) == (
        "rank 0 has waited 1801 s in the gradient sync of batch 412 of epoch 2 for the other ranks: rank 1 is in its "
        "own code after batch 412 of epoch 2 (411 gradient syncs done) at train.py:9 in main, at the same Python "
        "line for 60 s (AUTODIST_BUSY_TIMEOUT=1800 s: how long a rank alive in its own code is waited for; raise it "
        "if a rank is legitimately busy this long)\n"
        "rank 1's Python stack (most recent call last):\n"
        '  File "train.py", line 9, in main\n    time.sleep(1000)')
    assert judge(Status(rank=0, wait="x", wait_s=59.0), {1: stalled}, {1: 0.5}, timeout=60, settle=1) is None


def test_a_silent_rank_or_one_in_another_collective_is_named_within_the_timeout_though_another_is_busy():
    me = Status(rank=0, wait="gradient sync #5", wait_s=61.0)
    busy = Status(rank=1, syncs=4, at="train.py:88 in estimate_loss")
    elsewhere = Status(rank=2, syncs=4, wait="torch.distributed.barrier called at train.py:90 in main", wait_s=61.0)
    same = Status(rank=3, syncs=4, wait="gradient sync #5", wait_s=61.0)
    assert in_own_code(me, {1: busy, 3: same}, {}, 60) == [1]
    assert judge(me, {1: busy, 3: same}, {}, timeout=60, settle=1, busy=1800) is None
    assert in_own_code(me, {1: busy, 2: elsewhere}, {}, 60) == []
    assert "rank 2 waits in torch.distributed.barrier called at train.py:90 in main for 61 s" in \
        judge(me, {1: busy, 2: elsewhere}, {}, timeout=60, settle=1, busy=1800)
    silent = judge(me, {1: busy, 3: same}, {3: 61.0}, timeout=60, settle=1, busy=1800)
    assert "rank 3 sent no heartbeat for 61 s" in silent and silent.endswith("(AUTODIST_TIMEOUT=60 s)")
    assert in_own_code(me, {1: busy, 3: None}, {}, 60) == []  # never heard of
    assert in_own_code(me, {3: same}, {}, 60) == []  # every rank waits in it: the collective is stuck
    assert "every rank waits in it" in judge(me, {3: same}, {}, timeout=60, settle=1, busy=1800)
    arrived = Status(rank=3, syncs=4, wait="gradient sync #5", wait_s=0.4)  # back from its own code just now
    assert judge(me, {3: arrived}, {}, timeout=60, settle=1, busy=1800) is None  # not stuck: it may complete


def test_a_failed_or_ended_rank_is_an_error_at_once():
    me = Status(rank=2, wait=wait_words("sync", 4, None), wait_s=1.2)
    failed = Status(rank=0, state="failed", note="ValueError: boom")
    assert judge(me, {0: failed, 1: Status(rank=1)}, {}, timeout=60, settle=1) == \
        "rank 0 failed (ValueError: boom) while rank 2 waits in gradient sync #5"
    ended = Status(rank=1, state="exited", syncs=4, data_end=[0, 4])
    assert judge(me, {1: ended}, {}, timeout=60, settle=1).startswith(
        "rank 1 reached the end of its script (4 gradient syncs done; its data ended after batch 4 of epoch 0) "
        "while rank 2 waits in gradient sync #5: the ranks did not run the same collectives")
    # an end seen before the status could be current is not judged yet
    assert judge(Status(rank=2, wait="x", wait_s=0.5), {1: ended}, {}, timeout=60, settle=1) is None


def test_a_silent_rank_is_named_as_such():
    me = Status(rank=0, wait="the gradient sync of batch 3 of epoch 0", wait_s=6.0)
    message = judge(me, {1: Status(rank=1, position=[0, 2, 6], syncs=2)}, {1: 5.5}, timeout=5, settle=1)
    assert "rank 1 sent no heartbeat for 6 s (killed, frozen, or its host is unreachable; last seen it is in " \
           "its own code after batch 2 of epoch 0" in message
    assert where(Status(rank=1, wait="gradient sync #3", wait_s=4.2)) == "waits in gradient sync #3 for 4 s"


@pytest.mark.parametrize("value, expected", [(None, 60.0), ("5", 5.0), ("0.5", 0.5)])
def test_timeout_comes_from_the_environment(value, expected):
    assert hang_timeout({} if value is None else {"AUTODIST_TIMEOUT": value}) == expected


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_timeout_says_what_to_give(value):
    with pytest.raises(ValueError, match="AUTODIST_TIMEOUT"):
        hang_timeout({"AUTODIST_TIMEOUT": value})


# -- bad arguments --------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, words", [
    (lambda: autodist.no_sync("x"), TypeError, "Expect nn.Module for model, str found"),
    (lambda: autodist.no_sync(None), TypeError, "Expect nn.Module for model, NoneType found"),
    (lambda: autodist.no_sync(torch.zeros(2)), TypeError, "Expect nn.Module for model, Tensor found"),
    (lambda: autodist.synchronize_model("model"), TypeError, "autodist.synchronize_model takes the model"),
    (lambda: autodist.synchronize_model(nn.Linear(2, 2), what=5), TypeError, "what must be the string"),
    (lambda: autodist.synchronize_model(nn.Linear(2, 2), what="grads"), ValueError,
     "'gradients' or 'parameters', got 'grads'"),
    (lambda: autodist.synchronize_model(nn.Linear(2, 2), "buffers"), ValueError, "got 'buffers'"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call()


def _synchronize_models_that_differ(what):
    import torch.distributed as dist

    model = nn.Linear(4, 2 + dist.get_rank())  # never parallelized, and not the same on every rank
    model(torch.ones(3, 4)).sum().backward()
    try:
        autodist.synchronize_model(model, what=what)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["gradients", "parameters"])
def test_synchronize_model_on_models_that_differ_raises_on_every_rank(ranks, what):
    for message in ranks(2, _synchronize_models_that_differ, what, timeout=60):
        assert "autodist.synchronize_model: the ranks hold different models (parameter 'weight': shape " \
               "(2, 4) on rank 0, (3, 4) on rank 1)" in message


# -- real faults on real processes ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """The environment of a launched job: no launch of the caller's, tests/ importable, AUTODIST_TIMEOUT and
    AUTODIST_EXIT_TIMEOUT of TIMEOUT seconds, AUTODIST_BUSY_TIMEOUT of BUSY (tests/faults/test_fault_matrix.py
    uses it too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_",
                                                                      "LOCAL_", "AUTODIST_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["AUTODIST_TIMEOUT"] = env["AUTODIST_EXIT_TIMEOUT"] = str(TIMEOUT)
    env["AUTODIST_BUSY_TIMEOUT"] = str(BUSY)
    return env


class Job:
    """The two ranks of one run: exit statuses, outputs, and the seconds from the fault to the last exit."""

    def __init__(self, codes: list[int], outputs: list[str], ends: list[float]) -> None:
        self.codes, self.outputs = codes, outputs
        marks = [float(t) for out in outputs for t in re.findall(r"(?:fault at|loop done at) ([\d.]+)", out)]
        self.seconds = max(ends) - min(marks + ends)

    def lines(self, rank: int) -> list[str]:
        """What autodist printed on ``rank``, apart from parallelize's summary and the uneven-shards warning."""
        return [line for line in self.outputs[rank].splitlines() if line.startswith(f"[autodist rank {rank}]")
                and "parallelized" not in line and "do not split evenly" not in line]


def _run(fault: str, tmp_path, **extra: str) -> Job:
    for _ in range(3):  # the free port may be taken before rank 0 binds it: try another
        port, procs, logs = _free_port(), [], []
        for rank in range(2):
            env = child_env() | extra | {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                  "MASTER_PORT": str(port)}
            logs.append(open(tmp_path / f"rank{rank}.txt", "w+"))
            procs.append(subprocess.Popen([sys.executable, SCRIPT, fault, str(tmp_path / "ckpt.pt")], env=env,
                                          stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
        ends: list[float | None] = [None, None]
        deadline = time.time() + 120
        while None in ends and time.time() < deadline:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.time()
            time.sleep(0.02)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        if not any("address already in use" in o.lower() for o in outputs):
            break
    assert None not in ends, "a rank was still running after 120 s:\n" + "\n".join(outputs)
    return Job([p.returncode for p in procs], outputs, ends)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def normal_end(tmp_path_factory) -> Job:
    """A fault-free run: the other tests' time limits are this machine's pace now (its ``seconds``, from the end
    of the loop to the last exit), not a fixed number a slower or busy machine would miss."""
    return _run("none", tmp_path_factory.mktemp("normal-end"))


def _prompt(job: Job, normal_end: Job, within: float = 6.0) -> None:
    """The ranks ended ``within`` seconds of the fault, plus twice what a normal end takes here now (a hang, or
    an end at a timeout instead of the notice, takes longer)."""
    bound = within + 2 * normal_end.seconds
    assert job.seconds <= bound, (f"the ranks ended {job.seconds:.1f} s after the fault; expected within "
                                  f"{bound:.1f} s ({within:.0f} s + twice the {normal_end.seconds:.1f} s a normal end "
                                  f"took here)", job.outputs)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_normal_end_says_nothing(normal_end):
    job = normal_end
    assert job.codes == [0, 0], job.outputs
    for rank in range(2):
        assert job.lines(rank) == []
        assert "Traceback" not in job.outputs[rank] and "TCPStore" not in job.outputs[rank], job.outputs[rank]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_rank_stalled_in_user_code_is_waited_for_then_named_with_its_stack(tmp_path, normal_end):
    """Rank 1 asleep in its own code, its heartbeat going on: rank 0 says whom it waits for after
    AUTODIST_TIMEOUT, and stops every rank at AUTODIST_BUSY_TIMEOUT naming rank 1's line and stack."""
    job = _run("sleep", tmp_path)
    print(f"sleep in rank 1: all ranks exited {job.seconds:.1f} s after it fell asleep")
    assert job.codes == [1, 1], job.outputs
    *progress, last = job.lines(0)
    assert progress and all(re.fullmatch(
        r"\[autodist rank 0\] rank 0 has waited \d+ s in the gradient sync of batch 3 of epoch 0 for rank 1, which is "
        r"in its own code after batch 3 of epoch 0 \(2 gradient syncs done\) at faulty_train.py:\d+ in _inject <- "
        r"faulty_train.py:\d+ in main(, at the same Python line for \d+ s)?: its heartbeat goes on, so it is "
        rf"waited for up to AUTODIST_BUSY_TIMEOUT={BUSY} s", line) for line in progress), progress
    assert re.search(r"rank 0 has waited \d+ s in the gradient sync of batch 3 of epoch 0 for the other ranks: "
                     r"rank 1 is in its own code after batch 3 of epoch 0 \(2 gradient syncs done\) at faulty_train.py",
                     last), last
    assert last.endswith(f"(AUTODIST_BUSY_TIMEOUT={BUSY} s: how long a rank alive in its own code is waited for; "
                         f"raise it if a rank is legitimately busy this long)"), last
    assert "time.sleep(1000)" in job.outputs[0]  # rank 1's Python stack
    assert job.lines(1) == [f"[autodist rank 1] stopped because rank 0 found: {last[len('[autodist rank 0] '):]}"]
    assert "TCPStore" not in "".join(job.outputs), job.outputs
    assert BUSY <= job.seconds, job.seconds  # not stopped before the busy limit
    _prompt(job, normal_end, within=BUSY + 6)


@pytest.mark.slow
@pytest.mark.e2e
def test_rank_0_evaluating_alone_is_waited_for(tmp_path):
    """nanoGPT's pattern: rank 0 evaluates alone (here for 3 x AUTODIST_TIMEOUT and 2 s, so that rank 1's line at
    3 x AUTODIST_TIMEOUT does not race the evaluation's end) while rank 1 waits in the next
    gradient sync. With the default busy limit the job finishes, rank 1 saying once per interval whom it waits
    for; with a busy limit shorter than the evaluation every rank stops with the named error, and no socket
    warning or C++ backtrace of torch's follows (rank 0, which holds the store, leaves last)."""
    job = _run("evaluate", tmp_path, AUTODIST_BUSY_TIMEOUT="1800", EVALUATE_S=str(3 * TIMEOUT + 2))
    print(f"rank 0 evaluating for {3 * TIMEOUT + 2} s: the job ended {job.seconds:.1f} s after it began")
    assert job.codes == [0, 0], job.outputs
    assert job.lines(0) == [], job.outputs[0]
    lines = job.lines(1)
    assert 2 <= len(lines) <= 3, lines  # at TIMEOUT, then every TIMEOUT (min(60 s, AUTODIST_TIMEOUT))
    for line in lines:
        assert re.fullmatch(r"\[autodist rank 1\] rank 1 has waited \d+ s in the gradient sync of batch 3 of epoch 0 "
                            r"for rank 0, which is in its own code after batch 3 of epoch 0 \(2 gradient syncs done\) "
                            r"at faulty_train.py:\d+ in estimate_loss <- faulty_train.py:\d+ in _inject"
                            r"(, at the same Python line for \d+ s)?: its heartbeat goes on, so it is waited for up "
                            r"to AUTODIST_BUSY_TIMEOUT=1800 s", line), line
    assert all(f"rank {r} done" in job.outputs[r] for r in range(2))

    job = _run("evaluate", tmp_path, EVALUATE_S="1000")
    assert job.codes == [1, 1], job.outputs
    assert job.lines(1)[-1].endswith(f"(AUTODIST_BUSY_TIMEOUT={BUSY} s: how long a rank alive in its own code is "
                                     f"waited for; raise it if a rank is legitimately busy this long)"), job.outputs[1]
    assert job.lines(0)[-1].startswith("[autodist rank 0] stopped because rank 1 found: rank 1 has waited")
    for output in job.outputs:
        assert "TCPStore" not in output and "frame #" not in output and "Traceback" not in output, output


@pytest.mark.slow
@pytest.mark.e2e
def test_a_rank_that_raises_is_named_once_by_the_others(tmp_path, normal_end):
    job = _run("raise", tmp_path)
    print(f"exception in rank 1: all ranks exited {job.seconds:.1f} s after it")
    assert job.codes == [1, 1], job.outputs
    assert job.lines(0) == ["[autodist rank 0] rank 1 failed (ValueError: boom in rank 1's loss) while rank 0 "
                            "waits in the gradient sync of batch 3 of epoch 0"]
    assert "Connection" not in job.outputs[0] and "Traceback" not in job.outputs[0], job.outputs[0]
    assert "ValueError: boom in rank 1's loss" in job.outputs[1]  # its own traceback, as usual
    _prompt(job, normal_end)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_killed_rank_is_named_once_by_the_others(tmp_path, normal_end):
    job = _run("kill", tmp_path)
    print(f"SIGKILL of rank 1: rank 0 exited {job.seconds:.1f} s after it")
    assert job.codes == [1, -9], job.outputs
    assert job.lines(0) == ["[autodist rank 0] rank 1 died without a word (killed by a signal, out of memory, or "
                            "aborted in C++: see its own output) while rank 0 waits in the gradient sync of batch 3 "
                            "of epoch 0"]
    assert "Connection" not in job.outputs[0] and "Traceback" not in job.outputs[0], job.outputs[0]
    _prompt(job, normal_end)


@pytest.mark.slow
@pytest.mark.e2e
def test_loaders_of_different_lengths_fail_when_the_first_one_ends(tmp_path, normal_end):
    job = _run("uneven_loader", tmp_path)
    print(f"320 vs 256 samples: all ranks exited {job.seconds:.1f} s after the first")
    assert job.codes == [1, 1], job.outputs
    why = ("rank 1's data ended after batch 4 of epoch 0, but rank 0's has 5 batches (its DataLoader's dataset holds "
           "320 samples, this rank's 256)")
    assert f"ValueError: {why}" in job.outputs[1]
    assert job.lines(0) == [f"[autodist rank 0] rank 1 failed (ValueError: {why}, so rank 0 would wait forever in "
                            f"the gradient sync of batch 5: every rank must pass the same data to autodist.parallelize, "
                            f"which splits it between them) while rank 0 waits in the gradient sync of batch 5 of "
                            f"epoch 0"]
    _prompt(job, normal_end)


@pytest.mark.slow
@pytest.mark.e2e
def test_uneven_strided_shards_fail_when_the_short_rank_ends(tmp_path, normal_end):
    job = _run("uneven_shards", tmp_path)  # 101 samples, batches of 10: 6 steps on rank 0, 5 on rank 1
    print(f"101 samples over 2 strided shards: all ranks exited {job.seconds:.1f} s after the first loop ended")
    assert job.codes == [1, 1], job.outputs
    message = ("rank 1 reached the end of its script (5 gradient syncs done) while rank 0 waits in gradient sync "
               "#6: the ranks did not run the same collectives")
    assert job.lines(0)[0].startswith(f"[autodist rank 0] {message}")
    assert job.lines(1)[0].startswith(f"[autodist rank 1] stopped because rank 0 found: {message}")
    _prompt(job, normal_end)


@pytest.mark.slow
@pytest.mark.e2e
def test_save_on_rank_0_only_names_the_collective_and_the_line(tmp_path, normal_end):
    job = _run("save_on_rank0", tmp_path)
    print(f"autodist.save on rank 0 only: all ranks exited {job.seconds:.1f} s after rank 0 called it")
    assert job.codes == [1, 1], job.outputs
    line = job.lines(0)[0]
    assert "rank 1 reached the end of its script (6 gradient syncs done; its data ended after batch 6 of epoch 0) " \
           "while rank 0 waits in torch.distributed.all_reduce called at checkpoint.py" in line, line
    assert "in save <- faulty_train.py" in line, line
    assert job.lines(1)[0].startswith("[autodist rank 1] stopped because rank 0 found: rank 1 reached the end")
    _prompt(job, normal_end)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_stall_under_autodist_run_ends_the_job(tmp_path, normal_end):
    env = child_env()
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", SCRIPT, "sleep"], env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    fell_asleep = float(re.search(r"fault at ([\d.]+)", out).group(1))
    print(f"sleep in rank 1 under autodist run: the job ended {time.time() - fell_asleep:.1f} s after it "
          f"({time.time() - start:.1f} s in all)")
    assert proc.returncode != 0
    assert "rank 0 has waited" in out and "time.sleep(1000)" in out, out
    ended, bound = time.time() - fell_asleep, BUSY + 8 + 2 * normal_end.seconds
    assert ended <= bound, f"the job ended {ended:.1f} s after the stall; expected within {bound:.1f} s"


def _busy_limits():
    from autodist.faults.watchdog import _busy_limit
    from autodist.runtime.world import collective_timeout
    return collective_timeout(), _busy_limit(5.0, 1800.0), _busy_limit(5.0, 30.0)


def test_the_busy_limit_stays_inside_the_process_groups_own_timeout(ranks):
    """A group started by hand with a short timeout (here the test pool's 60 s; NCCL's default is 10 min) would
    end a collective before the busy limit: the limit is cut to fit, and the messages say why."""
    for group, (cut, words), (kept, kept_words) in ranks(2, _busy_limits):
        assert group == 60.0
        assert cut == 55.0 and words == ("55 s (AUTODIST_BUSY_TIMEOUT=1800 s, cut to the process group's timeout of "
                                         "60 s less AUTODIST_TIMEOUT: give init_process_group a longer timeout to "
                                         "wait longer)")
        assert (kept, kept_words) == (30.0, "AUTODIST_BUSY_TIMEOUT=30 s")
