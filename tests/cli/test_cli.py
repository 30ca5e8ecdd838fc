"""The `autodist` command: first contact (--version, help, python -m autodist), one-line errors for bad input,
and `autodist run` on real processes: the failed rank named once at the end, Ctrl-C, loopback-only sockets."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import autodist
from autodist.cli.command import main, torchrun_args
from autodist.cli.launch import Failure, python_command, root_cause, summary

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers
FAULTY = os.path.join(HERE, "faulty_train.py")
AUTODIST = [sys.executable, "-m", "autodist"]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_", "PMI_", "SLURM_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env | extra


# -- first contact ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_version_from_python_m_and_the_console_script():
    expected = f"autodist {autodist.__version__}"
    out = subprocess.run([*AUTODIST, "--version"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, expected, "")
    script = os.path.join(os.path.dirname(sys.executable), "autodist")  # what `pip install -e .` puts on PATH
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, expected)


def test_run_help_says_torchrun_options_pass_through(capsys):
    assert main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert "Every torchrun option passes through unchanged" in text
    for option in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts", "-n N", "--show-ranks",
                   "--raw-output"):
        assert option in text, option
    assert main([]) == 2 and "autodist run" in capsys.readouterr().out


def _write(folder, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(text)


# (arguments, what the one line must say); every case exits with status 2 and prints no traceback
BAD_INPUT = [
    (["explain", "cli_nets.py:build", "--mp", "2"], "'cli_nets.py' is a file path; give the module's import "
                                                     "name instead, e.g. 'cli_nets:NAME'"),
    (["explain", "no_such_module_xyz:build", "--mp", "2"], "no module named 'no_such_module_xyz'"),
    (["explain", "cli_nets:biuld", "--mp", "2"], "'cli_nets' has no name 'biuld'; did you mean 'build'?"),
    (["explain", "cli_nets:WIDTH", "--mp", "2"], "cli_nets:WIDTH is a int, not an nn.Module or a callable"),
    (["explain", "cli_nets:needs_width", "--mp", "2"], "cli_nets:needs_width cannot be called without arguments"),
    (["explain", "cli_nets:not_a_model", "--mp", "2"], "cli_nets:not_a_model() returned a str, not an nn.Module"),
    (["explain", "cli_nets:broken", "--mp", "2"], "calling cli_nets:broken raised ZeroDivisionError"),
    (["explain", "cli_broken_import:build", "--mp", "2"], "importing 'cli_broken_import' raised ModuleNotFoundError: "
                                                          "No module named 'missing_dependency_xyz'"),
    (["explain", "cli_nets", "--mp", "2"], "target must look like MODULE:NAME"),
    (["explain", "cli_nets:build", "--mp", "two"], "argument --mp: invalid int value: 'two'"),
    (["explain", "cli_nets:build", "--pp", "3"], "cli_nets:build with --pp 3: pp=3 stages need at least 3 blocks, "
                                                 "and Sequential has 2"),
    (["explain", "cli_nets:build", "--pp", "0"], "--pp must be an integer >= 1, got 0"),
    (["explain", "cli_nets:build", "--mp", "0"], "--mp must be an integer >= 1, got 0"),
    (["explain", "cli_nets:build"], "--mp K or --pp K is needed to explain a model (or give a saved plan"),
    (["explain", "no_such_plan.json"], "cannot read a plan from 'no_such_plan.json'"),
    (["explain", "cli_nets:build", "--mp", "2", "--batch-size", "-3"], "--batch-size must be an integer >= 1"),
    (["explian", "cli_nets:build"], "unknown command 'explian'; the commands are run and explain"),
    (["run", "-n", "2", "no_such_script.py"], "no such script 'no_such_script.py'"),
    (["run", "-n", "2", "--no-such-option", "x.py"], "unrecognized arguments: --no-such-option"),
    (["run", "-n", "two", "train.py"], "-n 'two': give a number of processes on this node (e.g. -n 2)"),
    (["run", "--nproc=0", "train.py"], "-n '0': give a number of processes"),
    (["run", "-n", "2", "--nnodes", "two", "train.py"], "--nnodes 'two': give a number of machines"),
    (["run", "-n", "2", "--nnodes", "4:1", "train.py"], "--nnodes '4:1': give a number of machines"),
    (["run", "-n", "2", "--max-restarts", "x", "train.py"], "--max-restarts/--max_restarts: invalid int value: 'x'"),
    (["run", "-n", "2", "--show-ranks", "2", "train.py"], "--show-ranks 2: this job has 2 rank(s), 0 to 1"),
    (["run", "-n", "2", "--raw-output", "--show-ranks", "0", "train.py"], "--show-ranks picks among labelled lines"),
]


QUICK_RUN = {"no_such_script.py", "two"}  # two `run` cases in the quick tier: each starts the launcher's child


def _bad_input_cases() -> list:
    return [pytest.param(argv, says, id=" ".join(argv[:2]),
                         marks=pytest.mark.slow if argv[0] == "run" and not QUICK_RUN & set(argv) else ())
            for argv, says in BAD_INPUT]


@pytest.mark.parametrize("argv, says", _bad_input_cases())
def test_bad_input_is_one_line_and_status_2(argv, says, tmp_path, monkeypatch, capfd):
    """``run``'s arguments are read by its launcher child (the supervising process loads nothing of torch), so
    the line is read from the file descriptors."""
    _write(tmp_path, "cli_nets", "import torch.nn as nn\nWIDTH = 3\n"
           "def build():\n    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))\n"
           "def needs_width(width):\n    return nn.Linear(width, width)\n"
           "def not_a_model():\n    return 'mlp'\n"
           "def broken():\n    return 1 / 0\n")
    _write(tmp_path, "cli_broken_import", "import missing_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(argv) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(("autodist explain: ", "autodist run: ", "autodist: ")), err
    assert says in err and "Traceback" not in err, err


@pytest.mark.slow
def test_bad_input_through_the_real_command(tmp_path):
    proc = subprocess.run([*AUTODIST, "explain", "models.py:build", "--mp", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("autodist explain: 'models.py' is a file path") and proc.stderr.count("\n") == 1


def test_explain_builds_the_model_from_a_dotted_name(tmp_path, monkeypatch, capsys):
    _write(tmp_path, "cli_zoo", "import torch.nn as nn\nclass Zoo:\n"
           "    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "cli_zoo:Zoo.mlp", "--mp", "2"]) == 0
    assert "column" in capsys.readouterr().out
    assert main(["explain", "cli_zoo:Zoo.mlp", "--pp", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["stage 0: 1 block (0), 68% of their bytes",
                                                         "stage 1: 1 block (2), 32% of their bytes"]


# -- what run hands torchrun -----------------------------------------------------------------------

def test_one_machine_meets_in_a_file_and_binds_loopback(tmp_path):
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    args = torchrun_args(["-n", "2", script, "-n", "x"], "/r", env={})
    assert args[:15] == ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "/r/rendezvous", "--rdzv-conf",
                         "store_type=file", "--rdzv-id", "autodist", "--local-addr", "127.0.0.1", "--log-dir",
                         "/r/logs", "--nproc-per-node"]
    assert args[15:18] == ["2", "--tee", "3"]  # each rank's lines tailed, labelled (tests/cli/test_rank_output.py)
    assert args[18:20] == ["--no-python", sys.executable]  # each rank runs the script inside autodist _rank
    assert args[-5:] == ["_rank", "--loopback-store", script, "-n", "x"]


def test_multi_node_options_and_a_module_pass_through(tmp_path):
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    args = torchrun_args(["--nproc=4", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--log-dir", "L", script],
                         "/r", env={})
    assert args[:11] == ["--nproc-per-node", "4", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--log-dir", "L",
                         "--tee", "3", "--no-python"]
    assert args[-2:] == ["_rank", script]  # nothing of the one-machine set-up
    assert torchrun_args(["-n2", "-m", "mypkg.train", "--lr", "1"], "/r", env={})[-8:] == \
        ["--nproc-per-node", "2", "-m", "--tee", "3", "mypkg.train", "--lr", "1"]  # not a file: run as torchrun would
    assert "--nnodes" not in torchrun_args(["-n", "2", script], "/r", env={"PET_NNODES": "2"})


# -- the summary (pure) ----------------------------------------------------------------------------

def test_the_rank_that_failed_first_is_named_not_the_ones_that_lost_it():
    raised = Failure(1, 1, "ValueError: boom", 10.5)
    lost = Failure(0, 1, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4", 10.4)
    stopped = Failure(2, -signal.SIGTERM, None, 10.0)
    by_watchdog = Failure(3, 1, None, 9.0)  # it exits 1 without an error of its own
    assert root_cause([lost, stopped, by_watchdog, raised]) is raised
    assert summary([lost, raised, stopped, by_watchdog], world=4) == \
        ["autodist run: rank 1 of 4 failed (exit code 1): ValueError: boom"]
    killed = Failure(1, -signal.SIGKILL, None, 11.0)
    assert root_cause([by_watchdog, killed]) is killed and killed.status == 137
    assert summary([killed]) == ["autodist run: rank 1 failed (killed by SIGKILL)"]
    lost_on_this_node = Failure(0, 1, "autodist.faults.watchdog.PeerFailure: rank 1 died without a word (...) while "
                                      "rank 0 waits in the gradient sync of batch 4 of epoch 84", 5.0)
    assert summary([lost_on_this_node]) == ["autodist run: rank 0 stopped (exit code 1): rank 1 died without a word "
                                            "(...) while rank 0 waits in the gradient sync of batch 4 of epoch 84"]
    two = summary([Failure(0, 1, "KeyError: 'x'", 3.0), Failure(1, 2, "OSError: disk full", 2.0)], world=2)
    assert two == ["autodist run: rank 1 of 2 failed (exit code 2): OSError: disk full",
                   "autodist run: rank 0 also failed (exit code 1): KeyError: 'x'"]


def test_a_rank_stopped_while_exiting_keeps_the_status_it_was_leaving_with(tmp_path):
    # Both ranks exit 2 (argparse); the launcher stops rank 1, already past its error, with SIGTERM: the summary
    # and the exit status of `autodist run` are the script's own, whichever rank recorded its error first.
    from types import SimpleNamespace

    from autodist.cli.launch import failure_of
    from autodist.runtime import ending

    said = "args.py: error: unrecognized arguments: --bogus"
    for rank, status in ((0, 2), (1, 2), (2, 1)):
        ending.record_error(said, said, path=str(tmp_path / f"{rank}.json"), status=status)
    ended = [failure_of(0, SimpleNamespace(error_file=str(tmp_path / "0.json"), exitcode=2, timestamp=9.0)),
             failure_of(1, SimpleNamespace(error_file=str(tmp_path / "1.json"), exitcode=-signal.SIGTERM,
                                           timestamp=9.0))]
    assert [(f.exitcode, f.error) for f in ended] == [(2, said), (2, said)]
    assert root_cause(ended).status == 2
    raised = failure_of(2, SimpleNamespace(error_file=str(tmp_path / "2.json"), exitcode=-signal.SIGTERM,
                                           timestamp=9.0))
    assert raised.exitcode == 1  # an uncaught error exits 1, as Python's does


def test_a_watchdog_verdict_is_the_summary_when_no_rank_raised():
    found = ("rank 0 has waited 5 s in the gradient sync of batch 4 of epoch 0 for the other ranks: rank 1 is in its "
             "own code")
    decider = Failure(0, 1, found, 12.0, verdict=True)
    obeyed = Failure(1, 1, f"stopped because rank 0 found: {found}", 11.9, verdict=True)
    assert summary([obeyed, decider], world=2) == [f"autodist run: the ranks were stopped: {found}"]
    assert summary([obeyed], world=2) == [f"autodist run: the ranks were stopped: rank 0 found: {found}"]
    raised = Failure(1, 1, "ValueError: boom", 13.0)
    told = Failure(0, 1, "rank 1 failed (ValueError: boom) while rank 0 waits in gradient sync #4", 12.5, verdict=True)
    assert summary([told, raised], world=2) == ["autodist run: rank 1 of 2 failed (exit code 1): ValueError: boom"]


# -- rank accessors --------------------------------------------------------------------------------

@pytest.mark.slow
def test_rank_and_world_size_under_every_launcher_and_engine_after_import():
    cases = [({}, [0, 1]),
             ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, [3, 4]),
             ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, [2, 3]),
             ({"PMI_RANK": "1", "PMI_SIZE": "2"}, [1, 2]),
             ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1"}, [5, 8]),
             ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, [0, 1])]  # an sbatch script without srun
    code = ("import json, os, sys, autodist\nout = []\n"
            "for env in json.loads(sys.argv[1]):\n"
            "    for k in [k for k in os.environ if k.startswith(('RANK', 'WORLD', 'OMPI', 'PMI', 'SLURM'))]:\n"
            "        del os.environ[k]\n"
            "    os.environ.update(env)\n"
            "    out.append([autodist.rank(), autodist.world_size()])\n"
            "print(json.dumps(out), autodist.engine.Metrics.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([env for env, _ in cases])], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    places, metrics = proc.stdout.rsplit(maxsplit=1)
    assert json.loads(places) == [want for _, want in cases]
    assert metrics == "Metrics"


# -- autodist run on real processes ----------------------------------------------------------------

def _run(*argv: str, timeout: float = 120, **env: str) -> tuple[int, str, float]:
    """`autodist run ARGV`: its exit status, its output, and when it ended."""
    proc = subprocess.run([*AUTODIST, "run", *argv], env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.time()


def _fault_at(out: str) -> float:
    return float(re.search(r"fault at ([\d.]+)", out).group(1))


def _summary(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("autodist run:")]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_rank_that_raises_is_named_at_the_end_with_its_error():
    code, out, end = _run("-n", "2", FAULTY, "raise", AUTODIST_TIMEOUT="5")
    print(f"autodist run, exception in rank 1: exited {end - _fault_at(out):.2f} s after it")
    assert code == 1, out
    assert _summary(out) == ["autodist run: rank 1 of 2 failed (exit code 1): ValueError: boom in rank 1's loss"]
    assert out.rstrip().endswith(_summary(out)[-1])  # after the launcher's output
    assert "ChildFailedError" not in out and "launch.py" not in out and "runpy" not in out, out
    assert out.count("Traceback") == 1  # rank 1's own, as python prints it
    assert end - _fault_at(out) <= 8


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("how, status, says", [
    ("argparse", 2, "args.py: error: unrecognized arguments: --bogus 4"),
    ("message", 1, "args.py: --bogus needs 4 ranks, this run has 2"),
])
def test_a_script_that_exits_with_an_error_is_named_with_what_it_said_last(tmp_path, how, status, says):
    script = tmp_path / "args.py"
    script.write_text("import argparse, sys\n"
                      "if sys.argv[1] == 'argparse':\n"
                      "    argparse.ArgumentParser(prog='args.py').parse_args(sys.argv[2:])\n"
                      "print('to stderr, then exiting', file=sys.stderr)\n"
                      "sys.exit('args.py: --bogus needs 4 ranks, this run has 2')\n")
    code, out, _ = _run("-n", "2", str(script), how, "--bogus", "4")
    assert code == status, out
    first, *also = _summary(out)  # the other rank is named too where it failed before it was stopped
    assert re.fullmatch(rf"autodist run: rank [01] of 2 failed \(exit code {status}\): {re.escape(says)}", first), out
    assert all(re.search(rf"also failed \(exit code \d+\): {re.escape(says)}$", line) for line in also), out


@pytest.mark.slow
@pytest.mark.e2e
def test_losing_rank_0_under_shard_parameters_says_so_without_torchs_backtraces():
    """Rank 0 hosts the rendezvous store: rank 1, waiting in a sharded block's all-gather, finds it gone. Before:
    torch's C++ warning printed its backtrace (24 frames and more), and the block's end hook its own silenced
    error, before autodist's line.

    The launcher polls its ranks every 0.1 s and stops the others once one died: rank 1's line races that poll
    (lost 1 run in 8 on a busy machine, where rank 1 was stopped before it printed anything). Rank 1's words are
    what is checked here, so the launcher polls every 2 s (the summary still names rank 0 either way)."""
    code, out, _ = _run("-n", "2", "--monitor-interval", "2", FAULTY, "kill0", AUTODIST_TIMEOUT="5")
    assert code == 128 + signal.SIGKILL, out
    assert _summary(out) == ["autodist run: rank 0 of 2 failed (killed by SIGKILL)"]
    assert "frame #" not in out and "always_call" not in out and "Traceback" not in out, out
    assert "[autodist rank 1] rank 0 is gone" in out, out


@pytest.mark.slow
@pytest.mark.e2e
def test_a_rank_killed_by_a_signal_is_named_at_the_end():
    code, out, end = _run("-n", "2", FAULTY, "kill", AUTODIST_TIMEOUT="5")
    print(f"autodist run, SIGKILL of rank 1: exited {end - _fault_at(out):.2f} s after it")
    assert code == 128 + signal.SIGKILL, out
    assert _summary(out) == ["autodist run: rank 1 of 2 failed (killed by SIGKILL)"]
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert end - _fault_at(out) <= 8


@pytest.mark.slow
@pytest.mark.e2e
def test_ctrl_c_stops_every_rank_with_one_line_and_status_130():
    proc = subprocess.Popen([*AUTODIST, "run", "-n", "2", FAULTY, "sleep"], env=_env(AUTODIST_TIMEOUT="120"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    for line in proc.stdout:  # rank 1 is asleep in its loop, rank 0 waits for it
        seen += line
        if "fault at" in seen and "parallelized" in seen:  # rank 0's summary line may come after rank 1's fault
            break
    time.sleep(0.5)
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    print(f"autodist run, Ctrl-C: exited {time.time() - sent:.2f} s after it")
    assert proc.returncode == 130, seen + rest
    assert rest.strip() == "autodist run: interrupted; stopping the ranks (again to kill them at once)", rest
    assert time.time() - sent <= 10


_LISTENERS = r'''
import json, os, socket, sys
import torch.distributed as dist
import autodist

before = [autodist.rank(), autodist.world_size()]
world = autodist.init()
dist.barrier()  # both ranks are in: every socket of the job is open


def children(pid):
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
        except OSError:
            pass
    return out


def listening(pids):
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                address, port = cols[1].split(":")
                found.append([address, int(port, 16)])
    return found


if world.rank == 0:
    launcher = os.getppid()
    job = [os.getppid(), *children(launcher), int(open(f"/proc/{launcher}/stat").read().rsplit(")", 1)[1].split()[1])]
    json.dump({"listening": listening(job), "port": int(os.environ["MASTER_PORT"]), "before": before,
               "after": [autodist.rank(), autodist.world_size()], "gloo": os.environ.get("GLOO_SOCKET_IFNAME")},
              open(sys.argv[1], "w"))
else:
    json.dump({"before": before, "after": [autodist.rank(), autodist.world_size()]}, open(sys.argv[2], "w"))
dist.barrier()
'''


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the socket table of /proc (Linux)")
@pytest.mark.parametrize("keep_going", [[], ["--keep-going"]], ids=["torchrun", "keep-going"])
def test_one_machine_listens_on_loopback_only_and_ranks_are_known_before_init(tmp_path, keep_going):
    script = tmp_path / "listeners.py"
    script.write_text(_LISTENERS)
    code, out, _ = _run(*keep_going, "-n", "2", str(script), str(tmp_path / "r0.json"), str(tmp_path / "r1.json"))
    assert code == 0, out
    r0, r1 = (json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2))
    assert (r0["before"], r0["after"], r1["before"], r1["after"]) == ([0, 2], [0, 2], [1, 2], [1, 2])
    loopback = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
    assert [r0["port"]] == [port for _, port in r0["listening"] if port == r0["port"]], r0  # the ranks' store
    assert all(address in loopback for address, _ in r0["listening"]), r0["listening"]
    assert r0["gloo"] == "lo"  # gloo's own choice would be the address the host name resolves to



def test_the_launchers_children_put_the_folder_holding_autodist_first_on_their_path():
    """`autodist run` starts its launcher and ranks with the folder of the autodist package first on sys.path:
    the package imports from there, and its own subfolders (runtime, train, ...) are no top-level names."""
    code = python_command("_rank")[-2]
    root = re.search(r"sys\.path\[0\] = '([^']+)'", code).group(1)
    assert os.path.samefile(os.path.join(root, "autodist"), os.path.dirname(autodist.__file__))


DDP_HABITS = """
import torch, torch.distributed as dist, autodist
from autodist.runtime.world import collective_timeout
loader = torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=4, shuffle=True)
model, loader = autodist.parallelize(torch.nn.Linear(3, 2), loader)
loader.sampler.set_epoch(1)     # DDP's habit: accepted in a world of one too
print("rank", dist.get_rank(), "of", dist.get_world_size(), [tuple(x.shape) for x in loader])
print("collectives wait", collective_timeout(), "s")
dist.barrier()
dist.destroy_process_group()   # the last line of a DDP script
"""


@pytest.mark.slow
def test_a_ddp_scripts_torch_distributed_calls_work_under_run_n_1(tmp_path):
    """Launched as one rank, autodist starts a process group of one (an in-process store), so get_rank,
    barrier and destroy_process_group at the end of a converted DDP script work; plain python has none."""
    script = tmp_path / "habits.py"
    script.write_text(DDP_HABITS)
    defaults = {k: v for k, v in _env().items() if not k.startswith("AUTODIST_")}
    out = subprocess.run([*AUTODIST, "run", "-n", "1", str(script)], capture_output=True, text=True, timeout=120,
                         env=defaults)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0 of 1 [(4, 3), (4, 3)]" in out.stdout
    # longer than the watchdog's limits (AUTODIST_BUSY_TIMEOUT + AUTODIST_TIMEOUT + 60 s): never torch's bare timeout
    assert f"collectives wait {1800 + 60 + 60:.1f} s" in out.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env())
    assert plain.returncode != 0 and "Default process group has not been initialized" in plain.stderr


LEFT_ALIVE = """
import torch, torch.distributed as dist
from autodist.runtime import ending
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(4), async_op=True).wait()   # work gloo's threads release later
ending.end_a_group_left_alive()
assert not dist.is_initialized()
ending.end_a_group_left_alive()                         # nothing left: nothing to do
print("ended")
"""


def test_a_gloo_group_the_script_left_alive_is_ended_before_the_interpreter_finalizes(tmp_path):
    """What each rank of `autodist run` does last (registered before the script runs): a gloo group the script
    started and never destroyed (Hugging Face Trainer's) is torn down while the interpreter is whole; left to
    the interpreter's end it aborted the process now and then (1 run in 8 of docs/frameworks.md's Trainer
    script: "terminate called without an active exception", status 134)."""
    out = subprocess.run([sys.executable, "-c", LEFT_ALIVE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stdout + out.stderr
    # a rank's wrapper ends it after the script: the script starts a group, leaves it, and watches the teardown
    script = tmp_path / "leaves_it.py"
    script.write_text("import torch.distributed as dist\nfrom autodist.runtime import ending\n"
                      "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
                      "torn = ending._tear_down\n"
                      "ending._tear_down = lambda: (print('torn down', flush=True), torn())\n")
    wrapped = f"from autodist.cli.launch import run_script; run_script([{str(script)!r}])"
    out = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "torn down", out.stdout + out.stderr
