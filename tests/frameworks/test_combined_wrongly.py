"""autodist combined wrongly with another data-parallel wrapper or a framework's own splitting: every way fails
loudly on every rank, naming the fix, and the right combination does not (under the real launcher: Accelerate,
Trainer and Lightning read the launcher's environment)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "combined_wrongly.py")

WRAPPED = ("TypeError", "is wrapped in")
INSIDE = ("RuntimeError", "runs inside DistributedDataParallel")
SPLIT = ("RuntimeError", "is being split by rank again")
OTHER_BATCH = ("RuntimeError", "not on the same global batch")
LIGHTNING = ("RuntimeError", "autodist.lightning.AutodistStrategy")
EXPECTED = {
    "ddp_before": WRAPPED,
    "ddp_after": INSIDE,
    "fsdp_before": WRAPPED,
    "fsdp_after": ("RuntimeError", "runs inside fully_shard"),
    "sampler_over_dataset": SPLIT,
    "accelerate_loader": SPLIT,
    "accelerate_model": INSIDE,
    "hf_trainer_data": SPLIT,
    "hf_trainer_model": INSIDE,
    "lightning_one_device_setup": LIGHTNING,
    "lightning_ddp_setup": LIGHTNING,
    "lightning_ddp_init": INSIDE,
    "rank_skips_a_batch": OTHER_BATCH,
    "rank_skips_a_batch_with_sharded_gradients": OTHER_BATCH,
    "sampler_seeded_per_rank": OTHER_BATCH,
    "uneven_and_empty_slices": None,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[str] | None]:
    folder = tmp_path_factory.mktemp("combined")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "PET_"))}
    env |= {"PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", SCRIPT, str(folder / "hf")],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    found = {}
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            result = json.loads(line.split("RESULT ", 1)[1])
            found[result["case"], result["rank"]] = result["error"]
    assert len(found) == 2 * len(EXPECTED), f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_fails_loudly_naming_the_fix(results: dict, case: str) -> None:
    for rank in (0, 1):
        error = results[case, rank]
        if EXPECTED[case] is None:
            assert error is None, error
            continue
        assert error is not None, f"{case} on rank {rank} raised nothing"
        kind, phrase = EXPECTED[case]
        assert error[0] == kind and phrase in error[1], error
        assert "docs/frameworks.md" in error[1]
        assert "\n" not in error[1]  # one line


def test_the_batch_identity_check_compares_only_the_ranks_that_know_their_batch() -> None:
    import torch

    from autodist.dp import same_batch

    def summed(*marks: int | None) -> torch.Tensor:
        total = torch.zeros(same_batch.SLOTS, dtype=torch.float32)
        for mark in marks:
            region = torch.empty(same_batch.SLOTS, dtype=torch.float32)
            same_batch.pack(region, mark, len(marks))
            total += region
        return total

    same_batch.check(summed(0xDEADBEEF, 0xDEADBEEF, None))  # the same batch, and a rank fed from elsewhere
    same_batch.check(summed(None, None))
    with pytest.raises(RuntimeError, match="not on the same global batch"):
        same_batch.check(summed(0xDEADBEEF, 0xDEADBEEF + 1, None))
    with pytest.raises(RuntimeError, match="not on the same global batch"):
        same_batch.check(summed(*range(1, 4)))  # the middle rank's mark is the mean: all ranks still see it
    for other in (0xDEADBEEF + 256, 0xDEADBEEF + (1 << 24)):  # equal modulo 256 (before: one step in 256 passed)
        with pytest.raises(RuntimeError, match="not on the same global batch"):
            same_batch.check(summed(0xDEADBEEF, other))
