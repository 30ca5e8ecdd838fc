"""Elastic data parallelism on real ranks under ``autodist run --elastic``: ranks lost at chosen points (SIGKILL
mid-backward, inside the optimizer step, between steps; rank 0, which would otherwise host the store; two in one
run; one frozen by SIGSTOP), and the ranks left finish the same training as one process, in float64; a rank busy
alone past the timeout is waited for, not lost; a rank restarted by the launcher joins back, exactly."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "elastic_train.py")  # tests/elastic_train.py

pytestmark = pytest.mark.slow


def _run(tmp_path, *args: str, ranks: int = 3, env: dict | None = None, restarts: int = 0) -> subprocess.CompletedProcess:
    launch = ["--max-restarts", str(restarts)] if restarts else []
    return subprocess.run([sys.executable, "-m", "autodist", "run", "--elastic", *launch, "-n", str(ranks), SCRIPT,
                           *args],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=os.environ | {"AUTODIST_TIMEOUT": "6", "AUTODIST_EXIT_TIMEOUT": "30"} | (env or {}))


_references: dict[tuple, dict] = {}


def _one_process(folder, epochs: int = 2, env: dict | None = None) -> dict:
    """The same script in one process, on the same global batches (run once for each epochs and env)."""
    key = (epochs, tuple(sorted((env or {}).items())))
    if key not in _references:
        out = folder / f"one{epochs}"
        subprocess.run([sys.executable, SCRIPT, str(out), "", str(epochs)], check=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | (env or {}))
        _references[key] = torch.load(f"{out}.0")
    return _references[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _one_process(tmp_path_factory.mktemp("reference"))


def _same_training(state: dict, reference: dict) -> None:
    """float64 at its floor: every parameter and buffer, and the optimizer's momentum."""
    for name, value in reference["params"].items():
        assert float((state["params"][name] - value).abs().max()) <= 1e-10, name
    assert len(state["momentum"]) == len(reference["momentum"])
    for mine, theirs in zip(state["momentum"], reference["momentum"]):
        assert float((mine - theirs).abs().max()) <= 1e-10
    assert state["lr"] == reference["lr"] and state["scheduler"] == reference["scheduler"]


@pytest.mark.parametrize("kills, lost", [
    ("2:3:between", [2]),
    ("1:5:step", [1]),
    ("2:4:backward", [2]),
    ("0:2:between", [0]),
    ("2:2:backward,0:9:step", [2, 0]),
])
def test_the_ranks_left_finish_the_same_training(tmp_path, reference, kills, lost):
    proc = _run(tmp_path, str(tmp_path / "out"), kills)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in lost:
        assert f"rank {rank} ended (killed by SIGKILL); the other ranks go on" in proc.stderr
    assert f"finished with {3 - len(lost)} of 3 ranks" in proc.stderr
    assert "the step in flight was abandoned" in proc.stdout + proc.stderr
    left = [rank for rank in range(3) if rank not in lost]  # autodist.rank(), world_size(): among those alive
    assert [torch.load(tmp_path / f"out.{rank}")["place"] for rank in left] == [(i, len(left)) for i in range(len(left))]
    for rank in range(3):
        wrote = (tmp_path / f"out.{rank}").exists()
        assert wrote == (rank not in lost), (rank, proc.stderr[-2000:])
        if wrote:
            state = torch.load(tmp_path / f"out.{rank}")
            _same_training(state, reference)
            # each abandoned step came back as one more iteration of the loop; the optimizer and its
            # scheduler took the single process's steps (compared above)
            assert state["taken"] == reference["taken"] + len(lost)


def _same_metrics(got: dict, reference: dict) -> None:
    assert got["count"] == reference["count"] and got["correct"] == reference["correct"], (got, reference)
    assert abs(got["loss"] - reference["loss"]) <= 1e-12 * abs(reference["loss"]), (got, reference)


@pytest.mark.parametrize("kills, lost, epoch0_count, env", [
    ("2:7:reduce", [2], 60, {}),  # after epoch 0's last sync, before its reduce: its 30 samples went with it
    ("2:3:between", [2], 74, {}),  # its 16 samples of steps 0-3; the abandoned step 4 counted once, not twice
    ("0:7:busyreduce", [], 90, {"AUTODIST_TIMEOUT": "3", "BUSY_S": "9"}),  # waited for: all three sum again
])
def test_engine_metrics_follow_the_ranks_alive(tmp_path, reference, kills, lost, epoch0_count, env):
    """engine.Metrics.reduce sums over the ranks alive together, under the sync's rules: a rank lost before
    or during it is left out (rank 0 says so), a rank busy past the timeout is waited for, and a batch taken
    again after a regroup counts once. Before: the reduce all-reduced on the default group, and the ranks left
    died with gloo's error."""
    proc = _run(tmp_path, str(tmp_path / "out"), kills, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    for rank in range(3):
        if rank in lost:
            continue
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        first, second = state["metrics"]
        assert first["count"] == epoch0_count, first
        if not lost:
            _same_metrics(first, reference["metrics"][0])
        _same_metrics(second, reference["metrics"][1])  # the next epoch whole, over the ranks left
    if lost:
        assert "engine.Metrics: lost since these sums began: rank 2" in said, said[-3000:]
    if kills.endswith("busyreduce"):
        assert "the metrics' sum was given up" in said and "elastic: lost" not in said, said[-3000:]


def test_a_restarted_rank_joins_and_the_three_train_the_same(tmp_path):
    # --max-restarts 1: rank 2 dies at step 3 and is started again; it joins at a step boundary with rank 0's
    # weights, momentum, scheduler, data position and random generator, and every rank ends as one process
    # does, over 3 epochs whose orders the global generator draws (the others come late to each epoch, so that
    # the joining rank draws the next order first)
    reference = _one_process(tmp_path, epochs=3)
    proc = _run(tmp_path, str(tmp_path / "out"), "2:3:between", "3", restarts=1,
                env={"STEP_S": "0.3", "EPOCH_S": "1.0", "JOIN_AT": "6"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "rank 2 ended (killed by SIGKILL); restarted (1 of 1), it joins the others after their next step" in said
    assert "member 3 joined at a step boundary" in said and "ranks 0, 1, 3 go on as generation 2" in said, said
    for rank in range(3):
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        assert state["states_in_store"] == []  # the model and optimizer sent to the joiner left the store once read
        assert state["place"] == (rank, 3)  # member 3, the joiner in slot 2, is the third of the ranks alive
    assert torch.load(tmp_path / "out.2")["taken"] < reference["taken"]  # it joined mid-run, from where the others were


def test_a_loss_at_an_epoch_boundary_keeps_the_next_epochs_order(tmp_path):
    # rank 1 dies after the last step of epoch 0: the first sync of epoch 1 is abandoned, that epoch is taken
    # up from its first batch (its order drawn again on its generators), and epoch 2 draws as one process
    proc = _run(tmp_path, str(tmp_path / "out"), "1:7:between", "3", env={"NO_METRICS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _one_process(tmp_path, epochs=3)
    for rank in (0, 2):
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        assert state["taken"] == reference["taken"] + 1


def test_a_frozen_rank_is_left_behind_after_the_timeout(tmp_path, reference):
    proc = _run(tmp_path, str(tmp_path / "out"), "1:4:freeze", env={"AUTODIST_TIMEOUT": "3"})
    said = proc.stdout + proc.stderr
    assert "elastic: lost rank 1" in said, said[-3000:]
    assert "autodist run: rank 1 stopped: its heartbeat stopped" in said, said[-3000:]  # by the launcher, named
    assert "finished with 2 of 3 ranks; lost rank 1 (killed by SIGKILL)" in said
    for rank in (0, 2):
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        assert state["taken"] == reference["taken"] + 1


def test_a_rank_busy_alone_past_the_timeout_is_waited_for(tmp_path, reference):
    # rank 0 evaluates alone for 3 x AUTODIST_TIMEOUT: the others' all-reduce gives up, but its heartbeat goes
    # on, so the next generation waits for it: the same three ranks redo the step
    proc = _run(tmp_path, str(tmp_path / "out"), "0:3:busy", env={"AUTODIST_TIMEOUT": "3", "BUSY_S": "9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "generation 1 waits for rank 0, alive in its own code" in said
    assert "while a rank was busy in its own code past AUTODIST_TIMEOUT" in said and "elastic: lost" not in said
    for rank in range(3):
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        assert state["taken"] == reference["taken"] + 1


def test_a_layout_that_cannot_lose_a_rank_restarts_every_rank_from_its_checkpoint(tmp_path):
    # shard="optimizer" under --elastic: a lost rank takes its shard with it, so the launcher, told so by the
    # ranks, starts every rank again and the script resumes from its checkpoint: bit-identical to a run that
    # never failed (tests/restart_train.py, rank 1 killed in epoch 2, a checkpoint after each epoch)
    script = os.path.join(os.path.dirname(HERE), "restart_train.py")
    env = os.environ | {"RESTART_LAYOUT": "shard-optimizer", "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, launch, marker in (("killed", ["--elastic", "--max-restarts", "1"], [str(tmp_path / "marker")]),
                                 ("straight", [], [])):
        (tmp_path / name).mkdir()
        runs[name] = subprocess.run([sys.executable, "-m", "autodist", "run", *launch, "-n", "2", script,
                                     str(tmp_path / name / "ckpt.pt"), str(tmp_path / name / "out.pt"), *marker],
                                    capture_output=True, text=True, timeout=240, env=env)
        assert runs[name].returncode == 0, runs[name].stdout[-2000:] + runs[name].stderr[-3000:]
    said = runs["killed"].stdout + runs["killed"].stderr
    assert "this job cannot go on without a lost rank (its layout has shard='optimizer'" in said, said[-3000:]
    assert "rank 1 ended (killed by SIGKILL); this job cannot go on without it" in said, said[-3000:]
    assert "every rank starts again, to resume from its last checkpoint (1 of 1)" in said
    restarted = torch.load(tmp_path / "killed" / "out.pt", weights_only=True)
    reference = torch.load(tmp_path / "straight" / "out.pt", weights_only=True)
    assert (restarted["restarts"], restarted["resumed_from"]) == (1, 2)
    for name, value in reference["state"].items():
        assert torch.equal(restarted["state"][name], value), name


STREAM = os.path.join(os.path.dirname(HERE), "elastic_stream_train.py")  # tests/elastic_stream_train.py


def _stream_run(folder, kill: str, *extra: str, ranks: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autodist", "run", "--elastic", "-n", str(ranks), STREAM,
                           str(folder / "out"), kill, *extra],
                          capture_output=True, text=True, timeout=240, cwd=folder,
                          env=os.environ | {"AUTODIST_TIMEOUT": "20", "AUTODIST_EXIT_TIMEOUT": "10"})


@pytest.mark.parametrize("kill", ["2:4", "1:7"])
def test_a_stream_with_accumulation_goes_on_without_a_lost_rank(tmp_path, kill):
    """A stream, 2 micro-batches under no_sync, a mean over the labels not ignored (each micro-batch's count summed
    over the ranks): rank 2 killed in a micro-batch inside no_sync (the ranks left were in that count's sum), rank
    1 in a syncing one. Before: a stream was refused (a restart from a checkpoint instead), and the count's sum
    killed the ranks left (a raw gloo error). Now the window is abandoned, the ranks left read the stream again to
    the last applied step, and end as one process does."""
    subprocess.run([sys.executable, STREAM, str(tmp_path / "one"), ""], check=True, timeout=120,
                   env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    proc = _stream_run(tmp_path, kill)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "finished with 2 of 3 ranks" in said and "the step in flight was abandoned" in said, said[-3000:]
    assert "resuming a stream in its epoch 0" in said
    one, elastic = torch.load(tmp_path / "one"), torch.load(tmp_path / "out")
    assert elastic["iterations"] == one["iterations"] + 2  # the abandoned window's micro-batches, taken again
    for name, value in one["params"].items():
        assert float((elastic["params"][name] - value).abs().max()) <= 1e-12, name


def test_a_stream_that_gives_other_batches_when_read_again_says_so(tmp_path):
    proc = _stream_run(tmp_path, "2:4", "changing")
    assert proc.returncode != 0
    assert "the stream gave another batch 1 of epoch 0 when read again after a lost rank" in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.parametrize("batch_norm", ["1", "nosync"])
def test_batch_norms_statistics_of_an_abandoned_step_are_undone(tmp_path, batch_norm):
    """A rank lost mid-backward: the ranks left had run the step's forward, which moved BatchNorm's running
    statistics. They go back to the last applied sync's, with sync_buffers=False too (before: kept there, then
    moved again when the batch came back)."""
    env = {"BATCHNORM": batch_norm}
    reference = _one_process(tmp_path, env=env)
    proc = _run(tmp_path, str(tmp_path / "out"), "2:4:backward", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the step in flight was abandoned" in proc.stdout + proc.stderr
    for rank in (0, 1):
        state = torch.load(tmp_path / f"out.{rank}")
        assert "1.running_mean" in state["params"]
        _same_training(state, reference)


def test_a_rank_frozen_at_the_end_of_the_script_is_stopped_and_the_job_ends(tmp_path, reference):
    """Rank 2 stops (SIGSTOP) after its last line, while the others wait for it at the end of the script. Before:
    they gave up there with status 1 and the launcher, which stopped stragglers only after a clean end, waited
    for rank 2 forever. Now the launcher stops it once its heartbeat has been still for AUTODIST_TIMEOUT and a
    few seconds, naming it, and the others end cleanly."""
    proc = _run(tmp_path, str(tmp_path / "out"), "2:0:endfreeze")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "autodist run: rank 2 stopped: its heartbeat stopped" in said, said[-3000:]
    assert "finished with 2 of 3 ranks; lost rank 2 (killed by SIGKILL)" in said
    for rank in range(3):
        _same_training(torch.load(tmp_path / f"out.{rank}"), reference)


@pytest.mark.parametrize("kills, lost, env", [
    ("2:4:backward", [2], {"BUCKET_MB": "0.0003"}),  # 4 buckets: the last layer's sent before the kill
    ("1:4:agree", [1], {}),  # rank 1's all-reduce completed, its agreement never counted: the count times out
    ("1:4:backward,2:4:backward", [1, 2], {}),  # two lost in the same sync: rank 0 goes on alone
])
def test_the_cases_the_agreement_exists_for(tmp_path, reference, kills, lost, env):
    """The sync is agreed on, not only summed: a rank whose all-reduce completed while another's failed (several
    buckets, the first on the wire before the loss), one that completed it and died before counting itself, and
    two lost at once. The ranks left finish as one process does (float64, 1e-10)."""
    proc = _run(tmp_path, str(tmp_path / "out"), kills, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert f"finished with {3 - len(lost)} of 3 ranks" in said and "the step in flight was abandoned" in said
    for rank in sorted(set(range(3)) - set(lost)):
        state = torch.load(tmp_path / f"out.{rank}")
        _same_training(state, reference)
        assert state["taken"] == reference["taken"] + 1  # the abandoned step, taken again once


GPT_SCRIPT = os.path.join(os.path.dirname(HERE), "elastic_gpt_train.py")  # tests/elastic_gpt_train.py


def test_nanogpt_loses_a_rank_mid_backward_and_trains_as_one_process(tmp_path):
    """An outside model: nanoGPT in float64 with AdamW, rank 1 killed as its gradient reaches the first block (the
    later blocks' gradients computed). Every rank left ends with one process's weights (1e-10)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, GPT_SCRIPT, str(tmp_path / "one"), ""], check=True, timeout=120, env=env)
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "--elastic", "-n", "3", GPT_SCRIPT,
                           str(tmp_path / "out"), "1:3"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=env | {"AUTODIST_TIMEOUT": "20", "AUTODIST_EXIT_TIMEOUT": "10"})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "finished with 2 of 3 ranks" in said and "the step in flight was abandoned" in said, said[-3000:]
    one, elastic = torch.load(tmp_path / "one"), torch.load(tmp_path / "out")
    assert max(float((elastic[k] - one[k]).abs().max()) for k in one) <= 1e-10


@pytest.mark.parametrize("write", ["state", "members", "joined", "takeoff"])
def test_an_admission_interrupted_at_each_write_still_admits_the_rank(tmp_path, write):
    """Rank 2 dies at step 3 and is started again to join; rank 0, admitting it, dies just before one of the
    admission's writes. Before: the join list was cleared first, so the joiner polled for AUTODIST_BUSY_TIMEOUT
    (or the members formed a group with a joiner that never learned it was admitted). Now every prefix of the
    writes is recoverable: rank 1, first of the ranks left, admits it at a later step, and both end as one
    process does."""
    reference = _one_process(tmp_path, epochs=3)
    proc = _run(tmp_path, str(tmp_path / "out"), "2:3:between", "3",
                env={"STEP_S": "0.3", "EPOCH_S": "1.0", "JOIN_AT": "6", "ADMIT_DIE": write}, restarts=1)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "rank 0 ended (killed by SIGKILL)" in said and "member 3 joined at a step boundary" in said, said[-3000:]
    for rank in (1, 2):  # rank 2's slot: the rank started again, member 3
        _same_training(torch.load(tmp_path / f"out.{rank}"), reference)
