"""Hugging Face Trainer launched by `autodist run` (Trainer's own DDP underneath, no parallelize): the same training
as one process on the same global batch where every global batch is whole, or where the short last one is dropped
(dataloader_drop_last=True, in both runs); not where Accelerate pads a short last global batch with repeated samples.

The script (hf_trainer_train.py) runs once on 2 ranks with 3 samples per rank and once as `python` with 6, both at
the same time; each trains three cases of a float64 GPT-2. transformers computes the loss in float32 whatever the
model's dtype, but both runs scale each token's loss by the same global count, so they differ by the order of
float64 sums only (about 1e-13): the tolerance tells that from a real difference. In float32 the whole-batch case
differs by 4e-5 after the same 12 AdamW steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer_train.py")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "PET_", "TORCHELASTIC_")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    return env | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both runs' output folders: 2 ranks with 3 samples each ("parallel"), one process with 6 ("single")."""
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("parallel", "single")}
    commands = {"parallel": [sys.executable, "-m", "autodist", "run", "-n", "2", SCRIPT, folders["parallel"], "3"],
                "single": [sys.executable, SCRIPT, folders["single"], "6"]}
    started = {name: subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True) for name, command in commands.items()}
    for name, process in started.items():
        try:
            output, _ = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        assert process.returncode == 0, f"{name} run failed:\n{output[-4000:]}"
    return folders


def _state(folder: str, case: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(folder, f"{case}.pt"), weights_only=True)


def _steps(folder: str, case: str, world: int) -> list[dict]:
    return [json.load(open(os.path.join(folder, f"{case}.rank{rank}.json"))) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("case", ["even", "drop_last"])
def test_trainer_under_autodist_run_trains_as_one_process_on_the_global_batch(runs, case):
    single = _steps(runs["single"], case, 1)
    parallel = _steps(runs["parallel"], case, 2)
    assert single[0]["world"] == 1 and single[0]["steps"] == 12
    assert parallel == [{"steps": 12, "world": 2}] * 2  # both ranks, as many optimizer steps as one process
    assert_close(_state(runs["parallel"], case), _state(runs["single"], case), rtol=1e-9, atol=1e-11)


@pytest.mark.slow  # the Trainer's runs (its module fixture) take 20 s: Lightning is the quick tier's framework
@pytest.mark.e2e
def test_a_short_last_global_batch_is_padded_with_repeated_samples(runs):
    """40 samples in global batches of 6 leave 4 at the end of each epoch: one process trains on those 4; on 2 ranks
    Accelerate (even_batches=True, Trainer's default) fills rank 1's slice of 1 with the first 2 samples of the
    epoch, so that step's gradient includes 2 samples twice. The steps agree; the weights do not (2e-2 measured)."""
    assert _steps(runs["single"], "padded", 1)[0]["steps"] == 14
    assert _steps(runs["parallel"], "padded", 2) == [{"steps": 14, "world": 2}] * 2
    parallel, single = _state(runs["parallel"], "padded"), _state(runs["single"], "padded")
    difference = max(float((parallel[k] - single[k]).abs().max()) for k in single)
    assert difference > 1e-4, f"the padded last batch now trains as one process ({difference:.1e}): update the docs"
