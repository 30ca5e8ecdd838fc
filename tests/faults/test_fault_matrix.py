"""The fault matrix: every sync mode and mp=2, each ending normally (no flush, no close) or with a fault on
rank 1 (an exception, SIGKILL, a stall), run for real under `autodist run` on 2 ranks (tests/matrix_train.py);
the row "elastic" is plain data parallelism under `autodist run --elastic`, where rank 0 finishes alone.

Every cell: autodist's own threads end with autodist's end (tests/matrix_train.py says which are left), every
process is gone within its bound (twice its mode's fault-free job in the same run, plus what
the fault waits by design, plus 20 s: the machine's pace now, not a fixed number a slower or busier machine
would miss), the job's exit status is non-zero exactly when something failed, the last line names the failed
rank and its cause, and the checkpoint written along the way loads.
The cells run three at a time (most of a cell is processes starting); the outcomes table of the faults
docs page is what this prints with ``-s``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from test_watchdog import BUSY, TIMEOUT, child_env

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the scripts
SCRIPT = os.path.join(HERE, "matrix_train.py")
MODES = ["backward", "elastic", "manual", "localsgd", "diloco", "gossip", "hierarchical", "downpour", "easgd", "mp2", "pp2",
         "shard-optimizer", "shard-gradients", "shard-parameters"]
FAULTS = ["none", "raise", "kill", "stall", "evaluate"]
LIMIT = 90  # seconds a cell may take where its mode's fault-free cell did not run (a cell run alone)
HANG = 300  # a cell still running then is stopped: a hang
WAITS = {"stall": BUSY, "evaluate": 3 * TIMEOUT}  # what a fault waits by design


@dataclass
class Cell:
    code: int
    output: str
    seconds: float  # from the start of `autodist run` to its end
    after_fault: float | None  # from the fault (or the end of the loop) to the end of the job
    checkpoint: str

    @property
    def last(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def _run(mode: str, fault: str, folder: str, ranks: int = 2) -> Cell:
    os.makedirs(folder, exist_ok=True)
    checkpoint = os.path.join(folder, "ckpt.pt")
    env = child_env()
    if fault == "evaluate":  # rank 0 busy for 3 x TIMEOUT: longer than BUSY, within the default busy limit
        del env["AUTODIST_BUSY_TIMEOUT"]
    start = time.time()
    try:
        elastic = ["--elastic"] if mode == "elastic" else []
        proc = subprocess.run([sys.executable, "-m", "autodist", "run", *elastic, "-n", str(ranks), SCRIPT, mode,
                               fault, checkpoint], env=env, capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{mode} x {fault}: the job was still running after {HANG} s:\n{e.stdout}\n{e.stderr}")
    end = time.time()
    output = proc.stdout + proc.stderr
    marks = [float(t) for t in re.findall(r"(?:fault at|done at) ([\d.]+)", output)]
    return Cell(proc.returncode, output, end - start, end - min(marks) if marks else None, checkpoint)


@pytest.fixture(scope="module")
def cells(request, tmp_path_factory) -> dict[tuple[str, str], Cell]:
    """Every cell this session selected, run three at a time."""
    wanted = [tuple(item.callspec.params[k] for k in ("mode", "fault")) for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "mode" in item.callspec.params]
    root = tmp_path_factory.mktemp("matrix")
    with ThreadPoolExecutor(3) as pool:
        futures = {cell: pool.submit(_run, *cell, str(root / "-".join(cell))) for cell in dict.fromkeys(wanted)}
    done = {cell: f.result() for cell, f in futures.items()}
    for mode in dict.fromkeys(m for m, _ in done):  # the table of docs/faults.md
        row = [f"{done[mode, f].code}, {_seconds(done[mode, f].after_fault)}" if (mode, f) in done else ""
               for f in FAULTS]
        stall = re.search(r"stopped: rank 0 (.*?) for the other", done[mode, "stall"].last) \
            if (mode, "stall") in done else None
        print(f"| {mode} | {' | '.join(row)} | {stall.group(1) if stall else ''} |")
    return done


def _seconds(value: float | None) -> str:
    """A cell's seconds for the table; a cell whose output has no mark (its own test says why) shows '-'."""
    return "-" if value is None else f"{value:.1f}"


def _bound(cells: dict[tuple[str, str], Cell], mode: str, fault: str) -> tuple[float, str]:
    """How long the cell may take, and why: twice its mode's fault-free job in this run, plus what the fault
    waits by design, plus 20 s; LIMIT where the fault-free cell did not run."""
    plain = cells.get((mode, "none"))
    if plain is None:
        return LIMIT, f"{LIMIT} s (its mode's fault-free cell did not run)"
    bound = 2 * plain.seconds + WAITS.get(fault, 0) + 20
    return bound, f"{bound:.0f} s (twice the {plain.seconds:.0f} s of its mode's fault-free job, + its wait, + 20 s)"


def _checkpoint_intact(cell: Cell, fault: str) -> None:
    """Written at step 2, before the fault: it loads, whole; nothing half-written lies beside it."""
    saved = torch.load(cell.checkpoint, weights_only=True)
    assert saved["extra"]["step"] == 2
    for name, value in saved["model"].items():
        assert torch.isfinite(value).all(), name
    assert os.listdir(os.path.dirname(cell.checkpoint)) == ["ckpt.pt"]


QUICK = {("backward", "kill")}  # the quick tier's cell: a real job, a rank killed, the others named


@pytest.mark.e2e
@pytest.mark.parametrize("mode, fault", [
    pytest.param(m, f, id=f"{m}-{f}", marks=() if (m, f) in QUICK else pytest.mark.slow) for m in MODES for f in FAULTS])
def test_cell(cells, mode, fault):
    cell = cells[mode, fault]
    bound, why = _bound(cells, mode, fault)
    assert cell.seconds < bound, f"{mode} x {fault} took {cell.seconds:.0f} s, expected under {why}:\n{cell.output}"
    assert "Traceback" not in cell.output or fault == "raise", cell.output
    # autodist's threads ended with it: one left in a store request as the interpreter finalizes aborts the rank
    assert "a thread of autodist's still runs after autodist's end" not in cell.output, cell.output
    if mode == "elastic":
        _elastic_cell(cell, fault)
    elif fault == "none":
        assert cell.code == 0, cell.output
        # no error; a rank slow to reach a collective (a loaded machine) may be waited for, with its progress line
        errors = [line for line in cell.output.splitlines()
                  if re.search(r"waited [\d.]+ s", line) and "so it is waited for up to" not in line]
        assert "autodist run:" not in cell.output and not errors, cell.output
        assert cell.output.count(" done at ") == 2
    elif fault == "raise":
        assert cell.code == 1, cell.output
        assert cell.last == "autodist run: rank 1 of 2 failed (exit code 1): ValueError: boom in rank 1's loss", \
            cell.output
    elif fault == "kill":
        assert cell.code == 137, cell.output
        assert cell.last == "autodist run: rank 1 of 2 failed (killed by SIGKILL)", cell.output
    elif fault == "stall":  # rank 1 asleep in its own code: waited for up to BUSY, with a line after TIMEOUT
        assert cell.code == 1, cell.output
        assert re.search(r"\[autodist rank 0\] rank 0 has waited \d s in .* for rank 1, which is in its own code "
                         r"after batch 4 of epoch 0 .* so it is waited for up to AUTODIST_BUSY_TIMEOUT", cell.output), \
            cell.output
        assert cell.last.startswith("autodist run: the ranks were stopped: rank 0 "), cell.output
        assert "rank 1 is in its own code after batch 4 of epoch 0" in cell.last, cell.output
        assert f"(AUTODIST_BUSY_TIMEOUT={BUSY} s: how long a rank alive" in cell.last, cell.output
        plain = cells.get((mode, "none"))
        ending = 2 * plain.after_fault if plain is not None and plain.after_fault is not None else 6
        assert BUSY <= cell.after_fault < BUSY + 6 + ending, (  # stopped at the busy limit, not at a timeout
            f"ended {cell.after_fault:.1f} s after the stall; expected from {BUSY} s to {BUSY + 6 + ending:.1f} s "
            f"(+ twice its mode's fault-free end)", cell.output)
    else:  # rank 0 evaluating alone for 3 x TIMEOUT: rank 1 says whom it waits for, and the job finishes
        assert cell.code == 0, cell.output
        assert cell.output.count(" done at ") == 2, cell.output
        assert re.search(r"\[autodist rank 1\] rank 1 has waited \d+ s in .* for rank 0, which is in its own code "
                         r"after batch 4 of epoch 0", cell.output), cell.output
        assert 3 * TIMEOUT <= cell.after_fault, cell.output
    _checkpoint_intact(cell, fault)


def _elastic_cell(cell: Cell, fault: str) -> None:
    """Under autodist run --elastic: rank 1 lost (raise, kill, or stalled past AUTODIST_BUSY_TIMEOUT), rank 0
    finishes alone, status 0, the last line naming the lost rank; rank 0 evaluating alone is waited for."""
    assert cell.code == 0, cell.output
    if fault in ("none", "evaluate"):
        assert cell.output.count(" done at ") == 2 and "autodist run:" not in cell.output, cell.output
        if fault == "evaluate":
            assert "waits for rank 0, alive in its own code" in cell.output, cell.output
            assert 3 * TIMEOUT <= cell.after_fault, cell.output
        return
    assert cell.output.count(" done at ") == 1, cell.output
    how = {"raise": "exit code 1: ValueError: boom in rank 1's loss", "kill": "killed by SIGKILL",
           "stall": "killed by SIGKILL"}[fault]
    assert cell.last == f"autodist run: finished with 1 of 2 ranks; lost rank 1 ({how})", cell.output
    assert "elastic: lost rank 1" in cell.output, cell.output
    if fault == "stall":  # asleep, its heartbeat on: waited for up to BUSY, then left; stopped at the end
        assert "waits for rank 1, alive in its own code" in cell.output, cell.output
        # named by whichever of the launcher's two watches sees it first: the end reached by rank 0 (the
        # store's "finished"), or rank 0's process gone
        assert re.search(r"rank 1 (stopped: )?still running", cell.output), cell.output
        assert BUSY <= cell.after_fault, cell.output


@pytest.mark.slow
@pytest.mark.e2e
def test_gossip_on_four_ranks_ends_without_flush(tmp_path):
    """The reported hang: Gossip on 4 ranks, no gossip.flush() at the end. The last exchange is waited for at
    exit, with a warning saying so, and the job ends in seconds."""
    cell = _run("gossip", "none", str(tmp_path), ranks=4)
    print(f"Gossip on 4 ranks without flush: the job ended {_seconds(cell.after_fault)} s after the loops")
    assert cell.code == 0, cell.output  # a hang would have been stopped by the watchdog: status 1
    # in seconds (4 ranks on 2 cores beside the rest of the suite: 1-6 s); had it waited for the exit timeout,
    # the status would be 1 (above), so this bound only catches a hang, with room for a slow or busy machine
    assert cell.after_fault is not None and cell.after_fault < 4 * TIMEOUT, (
        f"ended {_seconds(cell.after_fault)} s after the loops, expected under {4 * TIMEOUT} s", cell.output)
    assert "the script ended with its last exchange under way; autodist waited for it at exit" in cell.output


@pytest.mark.slow
@pytest.mark.e2e
def test_the_end_is_bounded_without_parallelize_too(tmp_path):
    """No watchdog (only autodist.init and autodist.comm): rank 1 never reaches its end; rank 0 waits at its
    end for AUTODIST_EXIT_TIMEOUT, names rank 1 and leaves with status 1 (the launcher then stops rank 1)."""
    cell = _run("comm", "stall", str(tmp_path))
    print(f"rank 1 asleep at its end, no watchdog: the job ended {cell.after_fault:.1f} s after the ranks' loops")
    assert cell.code == 1, cell.output
    assert cell.last == ("autodist run: the ranks were stopped: rank 0 reached the end of its script and waited 5 s "
                         "for the others: rank 1 did not reach the end of the script (AUTODIST_EXIT_TIMEOUT=5 s; "
                         "raise it if a rank legitimately finishes this much later)"), cell.output
    assert TIMEOUT <= cell.after_fault < TIMEOUT + 10, (  # the exit timeout, then the teardown (a few seconds)
        f"ended {cell.after_fault:.1f} s after the loops, expected from {TIMEOUT} to {TIMEOUT + 10} s", cell.output)
