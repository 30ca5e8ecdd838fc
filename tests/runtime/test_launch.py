"""Launcher detection (pure), and real launches: `autodist run` (torchrun) and an MPI-style environment."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

import workloads as w
from autodist.cli.command import UsageError, torchrun_args
from autodist.runtime.environment import Launch, detect_launch, rendezvous_address
from autodist.runtime.world import choose_backend

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "1234", "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}
    assert detect_launch(env) == Launch("torchrun", 3, 4, 1, 2, "node0", "1234")


def test_open_mpi_environment():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert detect_launch(env) == Launch("openmpi", 2, 4, 0, 2, None, None)


def test_mpich_environment():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert detect_launch(env) == Launch("mpich", 1, 2, 1, 2, None, None)


def test_slurm_environment():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),3", "MASTER_ADDR": "n1", "MASTER_PORT": "99"}
    assert detect_launch(env) == Launch("slurm", 5, 7, 1, 3, "n1", "99")


def test_sbatch_script_without_srun_is_a_world_of_one():
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).size == 1
    assert detect_launch({}) == Launch("none", 0, 1, 0, 1, None, None)


def test_missing_rendezvous_names_the_variables():
    multi_node = Launch("slurm", 0, 4, 0, 2, None, None)
    with pytest.raises(RuntimeError, match="set MASTER_ADDR and MASTER_PORT"):
        rendezvous_address(multi_node)
    single_node = Launch("openmpi", 0, 2, 0, 2, None, None)
    with pytest.raises(RuntimeError, match=r"set MASTER_PORT in every rank's environment.*mpirun -x"):
        rendezvous_address(single_node)
    assert rendezvous_address(Launch("openmpi", 0, 2, 0, 2, None, "29500")) == ("127.0.0.1", 29500)
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_backend_choice():
    assert choose_backend(None, 0, 2)[0] == "gloo"
    assert choose_backend(None, 4, 4)[0] == "nccl"
    backend, why = choose_backend(None, 1, 2)  # two processes share one GPU
    assert backend == "gloo" and "share 1 GPU" in why
    assert choose_backend("gloo", 8, 8) == ("gloo", "as requested")


def test_run_arguments_become_torchrun_arguments():
    script = os.path.join(HERE, "launched_train.py")
    single = torchrun_args(["-n", "2", script, "-n", "x"], "/run", env={})
    assert single[:2] == ["--nnodes", "1"] and "--standalone" not in single  # one machine, loopback only
    assert single[-5:] == ["_rank", "--loopback-store", script, "-n", "x"]
    multi = torchrun_args(["--nproc=4", "--nnodes", "2", "--rdzv-endpoint", "h:29400", script], "/run", env={})
    assert multi[:8] == ["--log-dir", "/run/logs", "--nproc-per-node", "4", "--nnodes", "2", "--rdzv-endpoint",
                         "h:29400"]
    assert multi[-2:] == ["_rank", script]
    with pytest.raises(UsageError, match="no such script"):
        torchrun_args(["-n", "2", "missing.py"], "/run", env={})


def _reference() -> dict:
    x, y = w.digits_like(22)
    return w.state(w.train(w.seeded(w.mlp, 0), w.loader(x, y, 8), "adam", 3))


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.e2e
def test_autodist_run_trains_like_one_process(tmp_path):
    out = tmp_path / "state.pt"
    cmd = [sys.executable, "-m", "autodist", "run", "-n", "2", os.path.join(HERE, "launched_train.py"), str(out)]
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = torch.load(out, weights_only=True)
    assert (saved["world"], saved["launcher"]) == (2, "torchrun")
    assert_close(saved["state"], _reference(), rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.e2e
def test_open_mpi_style_launch_trains_like_one_process(tmp_path):
    # What mpirun -np 2 -x MASTER_PORT=... gives each process: no torchrun variables at all.
    out = tmp_path / "state.pt"
    for _ in range(3):  # the free port may be taken by someone else before rank 0 binds it: try another
        procs, port = [], _free_port()
        for rank in range(2):
            env = _child_env() | {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                  "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "launched_train.py"), str(out)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=180)[0] for p in procs]
        if not any("address already in use" in o.lower() for o in outputs):
            break
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    saved = torch.load(out, weights_only=True)
    assert (saved["world"], saved["launcher"]) == (2, "openmpi")
    assert_close(saved["state"], _reference(), rtol=1e-5, atol=1e-6)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"backend gloo: {choose_backend(None, gpus, 2)[1]}" in outputs[0]  # the reason for this machine


@pytest.mark.slow
def test_explain_command_prints_the_plan(tmp_path):
    (tmp_path / "netdef.py").write_text("import torch.nn as nn\n"
                                        "def build():\n"
                                        "    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))\n")
    proc = subprocess.run([sys.executable, "-m", "autodist", "explain", "netdef:build", "--mp", "2",
                           "--batch-size", "32"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "column" in proc.stdout and "1,280" in proc.stdout  # 32 rows x 10 logits x 4 bytes
