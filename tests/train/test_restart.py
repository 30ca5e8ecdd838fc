"""A run killed mid-epoch and restarted by `autodist run --max-restarts` ends as the uninterrupted run does."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # jobs through the real launcher: the full tier

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts and shared helpers


def _launch(directory, *marker: str) -> subprocess.Popen:
    """`autodist run -n 2 --max-restarts 1 restart_train.py` writing into ``directory``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    os.makedirs(directory)
    cmd = [sys.executable, "-m", "autodist", "run", "-n", "2", "--max-restarts", "1",
           os.path.join(HERE, "restart_train.py"), str(directory / "ckpt.pt"), str(directory / "out.pt"), *marker]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_a_rank_killed_mid_epoch_restarts_and_ends_bit_identical(tmp_path):
    outputs = []
    for launch in (_launch(tmp_path / "killed", str(tmp_path / "killed" / "marker")),
                   _launch(tmp_path / "uninterrupted")):
        outputs.append(launch.communicate(timeout=240)[0])
        assert launch.returncode == 0, outputs[-1]

    restarted = torch.load(tmp_path / "killed" / "out.pt", weights_only=True)
    reference = torch.load(tmp_path / "uninterrupted" / "out.pt", weights_only=True)
    assert os.path.exists(tmp_path / "killed" / "marker")  # rank 1 did kill itself
    assert "resumed from" in outputs[0] and "resumed from" not in outputs[1]
    assert (restarted["restarts"], restarted["resumed_from"]) == (1, 2)  # the second attempt, from epoch 2
    assert (reference["restarts"], reference["resumed_from"]) == (0, 0)
    assert restarted["state"].keys() == reference["state"].keys()
    for name, value in reference["state"].items():
        assert torch.equal(restarted["state"][name], value), name
    assert sorted(os.listdir(tmp_path / "killed")) == ["ckpt.pt", "marker", "out.pt"]
    print(f"restart: {restarted['restart_s']:.2f} s from the SIGKILL to training again")
