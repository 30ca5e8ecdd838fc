"""What the ranks print under `autodist run`: every line whole and labelled with its rank (`[rank1]: ...`),
`--show-ranks` to print some ranks only (a hidden rank's crash still shown), `--raw-output` for the lines as
the ranks write them; through torchrun and with --keep-going."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from string import Template

import pytest

from autodist.cli.command import UsageError, output_of, torchrun_args
from autodist.cli.output import KEPT_LINES, LEFT_OUT, TEMPLATE, Output, RankLines, label

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
LINES = 300  # per rank and stream, printed by both ranks at once
WIDTH = 200


def _script(folder) -> str:
    """Every rank prints LINES long lines to stdout and to stderr at once, one line from C level and one from
    a subprocess; with `fail`, rank 1 raises once rank 0 has printed everything."""
    script = folder / "ranks_print.py"
    script.write_text(f'''
import os, subprocess, sys, time
import torch.distributed as dist
import autodist

rank = autodist.rank()
if sys.argv[1] == "together":
    autodist.init()
    dist.barrier()  # both ranks start printing at the same moment
for i in range({LINES}):
    print(f"rank {{rank}} line {{i}} " + str(rank) * {WIDTH})
    print(f"rank {{rank}} err {{i}} " + str(rank) * {WIDTH}, file=sys.stderr)
os.write(1, f"rank {{rank}} from C level\\n".encode())
subprocess.run([sys.executable, "-c", f"print('rank {{rank}} from a subprocess')"], check=True)
if sys.argv[1] == "together":
    dist.barrier()
    if rank == 0:  # half a line, the rest after rank 1 printed a whole one
        sys.stdout.write("rank 0 half")
        sys.stdout.flush()
        time.sleep(0.5)
        print(" a line")
    else:
        time.sleep(0.25)
        print("rank 1 meanwhile")
    dist.barrier()
done = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0.done")
if rank == 0:
    open(done, "w").close()
if sys.argv[1] == "fail" and rank == 1:
    while not os.path.exists(done):
        time.sleep(0.05)
    raise ValueError("boom on rank 1")
''')
    return str(script)


def _run(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_", "PMI_", "SLURM_", "PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "autodist", "run", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


# -- the options (pure) ----------------------------------------------------------------------------

def test_output_options_and_what_torchrun_is_given(tmp_path):
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    assert output_of(["-n", "2", script]) == Output()
    assert output_of(["-n", "4", "--show-ranks", "0,2", script]) == Output(shown=frozenset({0, 2}))
    assert output_of(["-n", "2", "--show-ranks=1", script]) == Output(shown=frozenset({1}))
    assert output_of(["-n", "2", "--raw-output", script]) == Output(labelled=False)
    assert output_of([script]) == output_of(["-n", "1", script]) == Output(labelled=False)  # one process: as python
    assert output_of(["-n", "1", "--nnodes", "2", script]) == Output()
    assert output_of(["-n", "2", script, "--raw-output"]) == Output()  # the script's argument
    args = torchrun_args(["-n", "2", "--show-ranks", "0", script, "--show-ranks", "1"], "/r", env={})
    assert args[args.index("--nproc-per-node"):][:4] == ["--nproc-per-node", "2", "--tee", "3"]
    assert args.count("--show-ranks") == 1 and args[-2:] == ["--show-ranks", "1"]  # the script's only
    for raw in (["--raw-output"], ["--tee", "1"], ["--redirects", "3"], ["-n", "1"]):
        args = torchrun_args(["-n", "2", *raw, script], "/r", env={})
        assert args.count("--tee") == raw.count("--tee") and "--raw-output" not in args, args


@pytest.mark.parametrize("argv, says", [
    (["--show-ranks", "x"], "--show-ranks 'x': give ranks as numbers separated by commas, e.g. 0 or 0,3"),
    (["--show-ranks", "2"], "--show-ranks 2: this job has 2 rank(s), 0 to 1"),
    (["--show-ranks", "0", "--raw-output"], "--show-ranks picks among labelled lines and --raw-output has none"),
])
def test_output_options_mistaken(tmp_path, argv, says):
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    with pytest.raises(UsageError, match=re.escape(says)):
        torchrun_args(["-n", "2", *argv, script], "/r", env={})


def test_output_travels_to_the_launcher_as_text():
    for output in (Output(), Output(labelled=False), Output(shown=frozenset({3, 0}))):
        assert Output.parse(str(output)) == output
    assert str(Output(shown=frozenset({3, 0}))) == "0,3"
    with pytest.raises(ValueError):
        Output(labelled=False, shown=frozenset({0}))
    assert Template(TEMPLATE).substitute(rank=12) == label(12) == "[rank12]: "  # torchrun's prefix is ours


def test_rank_lines_print_the_shown_ranks_and_keep_the_last_lines_of_the_others():
    stream = io.StringIO()
    lines = RankLines(stream, shown=frozenset({0}))
    lines.write("[rank0]: loss 0.25\n")
    lines.write("[rank1]: loss 0.5\n")
    lines.write("autodist run: not a rank's line\n")
    lines.write("[rank0]: [rank0]: Traceback (most recent call last):\n")  # torch's excepthook labels it too
    lines.write("[rank0]: [rank0]:[W1125 12:00:00] a C++ warning\n")
    for i in range(100):
        lines.write(f"[rank1]: [rank1]: line {i}\n")
    assert stream.getvalue().splitlines() == ["[rank0]: loss 0.25", "autodist run: not a rank's line",
                                              "[rank0]: Traceback (most recent call last):",
                                              "[rank0]: [W1125 12:00:00] a C++ warning"]
    stream.truncate(0)
    stream.seek(0)
    lines.show_kept(1)
    assert stream.getvalue().splitlines() == [f"[rank1]: line {i}" for i in range(60, 100)]
    lines.show_kept(1)  # shown once
    assert stream.getvalue().count("\n") == 40
    every = RankLines(io.StringIO())
    every.write("[rank7]: shown\n")
    assert every.getvalue() == "[rank7]: shown\n"


def test_rank_lines_hold_a_half_line_until_its_end_comes():
    stream = io.StringIO()
    lines = RankLines(stream, shown=frozenset({0, 1}))
    lines.write("[rank0]: half")         # torchrun read rank 0's file up to the middle of a line
    lines.write("[rank1]: whole\n")
    lines.write("[rank0]:  and the rest\n")
    lines.write("[rank1]: no newline at the end")
    assert stream.getvalue() == "[rank1]: whole\n[rank0]: half and the rest\n"
    lines.finish()
    assert stream.getvalue().endswith("[rank1]: no newline at the end\n")
    hidden = RankLines(io.StringIO(), shown=frozenset({0}))
    hidden.write("[rank1]: Value")
    hidden.write("[rank1]: Error: boom")
    hidden.show_kept(1)  # a hidden rank's last words, finished
    assert hidden.getvalue() == "[rank1]: ValueError: boom\n"


def test_torchs_cpp_backtrace_becomes_one_line():
    stream = io.StringIO()
    lines = RankLines(stream)
    warning = "[rank1]: [W1129 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed: Connection reset by peer\n"
    lines.write(warning)
    lines.write("[rank1]: Exception raised from recvBytes at /torch/csrc/distributed/c10d/Utils.hpp:784 "
                "(most recent call first):\n")
    lines.write("[rank0]: rank 0 goes on\n")
    for i in range(3):
        lines.write(f"[rank1]: frame #{i}: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7fe9 in libc10.so)\n")
    lines.write("[rank1]: <omitting python frames>\n")
    lines.write("[rank1]: frame #43: __libc_start_main + 0x85 (0x7fe9 in libc.so.6)\n")
    lines.write("[rank1]: after\n")
    lines.write("[rank1]: frame #7 of a line of the user's own\n")
    assert stream.getvalue() == (warning + "[rank1]: " + LEFT_OUT + "[rank0]: rank 0 goes on\n[rank1]: after\n"
                                 "[rank1]: frame #7 of a line of the user's own\n")


# -- real launches ---------------------------------------------------------------------------------

def _own_lines(text: str, word: str) -> dict[int, int]:
    """How many well-formed lines of ``word`` ("line" or "err") each rank printed; fails on a mixed line."""
    counts = {0: 0, 1: 0}
    whole = re.compile(rf"\[rank([01])\]: rank \1 {word} \d+ \1{{{WIDTH}}}")
    for line in text.splitlines():
        if f" {word} " in line:
            assert whole.fullmatch(line), f"not one rank's whole line: {line!r}"
            counts[int(line[5])] += 1
    return counts


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", [[], ["--keep-going"]], ids=["torchrun", "keep-going"])
def test_every_line_is_whole_and_labelled_with_its_rank(tmp_path, mode):
    proc = _run(*mode, "-n", "2", _script(tmp_path), "together", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _own_lines(proc.stdout, "line") == {0: LINES, 1: LINES}, proc.stdout[-2000:]
    assert _own_lines(proc.stderr, "err") == {0: LINES, 1: LINES}, proc.stderr[-2000:]
    for rank in (0, 1):  # what the rank's file descriptor 1 got, not only Python's sys.stdout
        assert f"[rank{rank}]: rank {rank} from C level\n" in proc.stdout
        assert f"[rank{rank}]: rank {rank} from a subprocess\n" in proc.stdout
    # the half line waited for its end: rank 1's whole line did not land in the middle of it
    assert "[rank0]: rank 0 half a line\n" in proc.stdout and "[rank1]: rank 1 meanwhile\n" in proc.stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", [[], ["--keep-going"]], ids=["torchrun", "keep-going"])
def test_show_ranks_prints_rank_0_only_and_still_a_crash_of_rank_1(tmp_path, mode):
    proc = _run(*mode, "-n", "2", "--show-ranks", "0", _script(tmp_path), "fail", cwd=tmp_path)
    last = "autodist run: rank 1 of 2 failed (exit code 1): ValueError: boom on rank 1"
    if mode:  # the job goes on without a lost rank
        last = "autodist run: finished with 1 of 2 ranks; lost rank 1 (exit code 1: ValueError: boom on rank 1)"
    assert proc.returncode == (0 if mode else 1), proc.stdout + proc.stderr
    assert _own_lines(proc.stdout, "line") == {0: LINES, 1: 0} and "[rank1]" not in proc.stdout
    # Of rank 1, only its last lines on stderr, the traceback's among them, just before the last line.
    shown = [line for line in proc.stderr.splitlines() if line.startswith("[rank1]")]
    assert len(shown) == KEPT_LINES and _own_lines(proc.stderr, "err") == {0: LINES, 1: KEPT_LINES - 4}
    assert shown[-4] == "[rank1]: Traceback (most recent call last):", proc.stderr[-3000:]
    assert shown[-1] == "[rank1]: ValueError: boom on rank 1", proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("\n".join(shown) + "\n" + last), proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.e2e
def test_raw_output_is_what_the_ranks_write(tmp_path):
    proc = _run("-n", "2", "--raw-output", _script(tmp_path), "alone", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr
    for rank in (0, 1):
        assert proc.stdout.count(f"rank {rank} line ") == LINES and proc.stderr.count(f"rank {rank} err ") == LINES
