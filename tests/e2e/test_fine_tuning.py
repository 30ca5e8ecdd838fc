"""docs/fine-tuning.md's SFT script, as the page gives it, under every route autodist runs it: each ends with the
weights of one process on the same batches (float64).

A Hugging Face causal LM (GPT-2, which computes in its weights' dtype throughout; Qwen2, whose RMSNorm and rotary
embeddings compute in float32 whatever the weights' dtype), prompt/response pairs from a ``datasets`` stream,
padded batches with labels at -100, AdamW with warmup, 2 micro-batches under ``no_sync``, ``clip_grad_norm_``,
checkpoints, ``engine.Metrics``. The routes: 2 ranks, ``shard="parameters"``, ``plan="auto"``, ``torch.compile``,
a rank killed and every rank restarted from the last checkpoint, and a rank lost under ``--elastic`` with 3.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from docs_blocks import ROOT, blocks_of

pytestmark = pytest.mark.slow  # jobs through the real launcher: the full tier
pytest.importorskip("transformers")
pytest.importorskip("datasets")

PAGE = ROOT / "docs" / "fine-tuning.md"
LAUNCH = [sys.executable, "-m", "autodist", "run"]
ROUTES = {  # name: (the launch, the script's options)
    "2 ranks": ([*LAUNCH, "-n", "2"], []),
    "shard='parameters'": ([*LAUNCH, "-n", "2"], ["--shard", "parameters"]),
    "plan='auto'": ([*LAUNCH, "-n", "2"], ["--plan", "auto"]),
    "torch.compile": ([*LAUNCH, "-n", "2"], ["--compile", "aot_eager"]),
    "killed and restarted": ([*LAUNCH, "-n", "2", "--max-restarts", "1"], ["--die-at", "7"]),
    "--elastic, a rank lost": ([*LAUNCH, "--elastic", "-n", "3"], ["--die-at", "7"]),
}
FLOOR = {"gpt2": 1e-10, "qwen2": 1e-6}  # Qwen2: float32's rounding inside the model, 24 Adam steps on


def _files(folder) -> None:
    """The page's files, written where a reader saves them."""
    for block in blocks_of(PAGE):
        if block.file is not None:
            (folder / block.file).write_text(block.code)


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    return env | {"OMP_NUM_THREADS": "1", "AUTODIST_TIMEOUT": "20", "PYTHONUNBUFFERED": "1"}


def _run(command: list[str], folder) -> str:
    out = subprocess.run(command, cwd=folder, env=_environment(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{' '.join(command)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """family -> its folder: the page's files, the model and data prepare.py made, one process's weights (made at
    the first test of the family)."""
    made: dict = {}

    def reference(family: str):
        if family not in made:
            folder = made[family] = tmp_path_factory.mktemp(f"sft-{family}")
            _files(folder)
            _run([sys.executable, "prepare.py", family], folder)
            _run([sys.executable, "sft.py", "--dtype", "float64", "--out", "weights.pt"], folder)
        return made[family]
    return reference


def _difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES = [("gpt2", route) for route in ROUTES] + [("qwen2", "2 ranks"), ("qwen2", "--elastic, a rank lost")]


@pytest.mark.parametrize("family, route", CASES)  # Qwen2 two routes, at its float32 floor; GPT-2 each, at float64's
def test_each_route_trains_as_one_process(one_process, family, route, tmp_path):
    reference = one_process(family)
    _files(tmp_path)
    for name in ("base", "sft.jsonl"):
        os.symlink(reference / name, tmp_path / name)
    launch, options = ROUTES[route]
    said = _run([*launch, "sft.py", "--dtype", "float64", "--out", "weights.pt", *options], tmp_path)
    if "--die-at" in options:  # the drill ran: a rank died, and the run went on or started again
        assert (tmp_path / "died").exists(), said[-3000:]
        assert ("resumed from" in said) if "--max-restarts" in launch else ("elastic: lost rank 2" in said), said[-3000:]
    difference = _difference(torch.load(tmp_path / "weights.pt"), torch.load(reference / "weights.pt"))
    print(f"{family}, {route}: {difference:.1e} from one process")
    assert difference <= FLOOR[family]
    compared = _run([sys.executable, "compare.py", str(reference / "weights.pt"), "weights.pt",
                     str(FLOOR[family])], tmp_path)
    assert "largest difference" in compared
