"""A test file run as a script by torchrun on fresh processes, as a user runs a plan: the test's rank pools hold what
earlier tests left (buffers, caches), which a finalist's measured peak can include. Each rank of the script writes
its result as JSON to ``OUT.<rank>``; :func:`launched` runs it and reads them back."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launched(script: str, ranks: int, out: pathlib.Path, *args: str) -> list[Any]:
    """``script OUT ARGS...`` on ``ranks`` fresh processes through torchrun; every rank's result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env["PYTHONPATH"] = os.pathsep.join([TESTS, os.path.dirname(script), os.path.dirname(TESTS)])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), script, str(out), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def write(out: str, rank: int, result: Any) -> None:
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps(result))
