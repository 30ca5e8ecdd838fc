"""How every benchmark takes its options and starts itself on ranks. Not a benchmark itself.

A benchmark is one script that runs twice over. As typed (``python benchmarks/bench_dp.py ...``) it parses
its options and starts copies of itself with the hidden ``--worker`` flag on its ranks, passing on every
option with the value it parsed; each copy parses them again and runs the benchmark's worker. Where a
benchmark has a single-process part (``bench_dp.py``'s world of one), that runs next, as ``--solo``, in a
process of its own, so the parts never share the cores. A worker runs with ``--threads`` torch threads
(1 where the benchmark has no such option).

Every benchmark has ``--quick``: a smoke run of seconds that goes the whole way (the launch, both
contenders, the agreement checks, the printed table) and times nothing worth reading. It sets the
options its benchmark names (``quick=`` of :meth:`Parser.parse`) to tiny values, over whatever the
command line said, so ``python benchmarks/NAME.py --quick ANY OPTIONS`` stays short; the workers get the
values it set.

A benchmark's script reads::

    parser = harness.Parser(__file__, __doc__, ranks=2, threads=True)
    parser.blocks(steps=10, rounds=20, warmup=5)
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1})
    sys.exit(harness.run(parser, args, worker))

``harness.run`` starts ``worker(args)`` on the ranks through torchrun (the default), or hands the parsed
options to a ``launch`` of the benchmark's own (two hosts in network namespaces, ranks started as mpirun
starts them), which uses :meth:`Parser.forwarded` and :func:`worker_command` or :func:`mpirun`.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

Run = Callable[[argparse.Namespace], Any]
NOT_FORWARDED = {"help", "quick", "worker", "solo"}  # the launch's own business: never passed to a worker


class Parser(argparse.ArgumentParser):
    """A benchmark's options: the first line of its docstring as the description, ``--quick``, the hidden
    ``--worker`` (and ``--solo`` with ``solo=True``); ``--ranks`` (default ``ranks``) with
    ``ranks_option=True``, else ``ranks`` is fixed; ``--threads`` with ``threads=True``; ``--device`` with
    ``device=True`` (see :func:`device_of`)."""

    def __init__(self, script: str, doc: str, *, ranks: int = 2, ranks_option: bool = False,
                 threads: bool = False, solo: bool = False, device: bool = False) -> None:
        super().__init__(description=doc.strip().splitlines()[0])
        self.script, self.ranks = os.path.abspath(script), ranks
        self.min_steps: int | None = None  # set by blocks()
        self.quick = self.add_argument("--quick", action="store_true",
                                       help="a smoke run of seconds: every part runs, nothing is timed worth reading")
        if ranks_option:
            self.add_argument("--ranks", type=int, default=ranks, help=f"processes to start (default {ranks})")
        if threads:
            self.add_argument("--threads", type=int, default=1, help="torch threads per process")
        if device:
            self.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                              help="where the models and batches live (cuda: the GPU each rank is pinned to, "
                                   "shared by the ranks where there are fewer GPUs than ranks)")
        self.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        if solo:
            self.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)

    def blocks(self, *, steps: int, rounds: int, warmup: int, min_steps: int = 1,
               steps_help: str = "steps per block") -> None:
        """The interleaving's options: steps per block, rounds of blocks, untimed steps first (checked by
        :meth:`parse`: at least ``min_steps`` steps and 2 rounds, as the quartiles need two values)."""
        self.add_argument("--steps", type=int, default=steps, help=steps_help)
        self.add_argument("--rounds", type=int, default=rounds, help="blocks of each contender")
        self.add_argument("--warmup", type=int, default=warmup, help="untimed steps of each contender first")
        self.min_steps = min_steps

    def parse(self, quick: Mapping[str, Any], argv: list[str] | None = None) -> argparse.Namespace:
        """The options; with ``--quick``, ``quick``'s values (option name: value) over the given ones."""
        settings = " ".join(f"--{name.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                            for name, v in quick.items())
        self.quick.help = f"{self.quick.help} (sets {settings})"
        args = self.parse_args(argv)
        if args.quick:
            for name, value in quick.items():
                setattr(args, name, value)
        if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
            self.error("--device cuda: this machine has no CUDA device (torch sees none)")
        if self.min_steps is not None and (args.steps < self.min_steps or args.rounds < 2):
            self.error(f"need --steps >= {self.min_steps} and --rounds >= 2 (the quartiles need at least two values)")
        return args

    def forwarded(self, args: argparse.Namespace) -> list[str]:
        """Every option of ``args`` but the launch's own, as command-line words that parse back to it.

        A list becomes one comma-separated word (the benchmarks' list options split on commas), or,
        for an ``append`` option, the option repeated; a flag is passed when set.
        """
        words: list[str] = []
        for action in self._actions:
            if not action.option_strings or action.dest in NOT_FORWARDED:
                continue
            option, value = action.option_strings[-1], getattr(args, action.dest)
            if action.nargs == 0:  # store_true and the like
                words += [option] if value else []
            elif isinstance(action, argparse._AppendAction):
                words += [f"{option}={v}" for v in value]
            elif isinstance(value, (list, tuple)):
                words.append(f"{option}={','.join(map(str, value))}")
            elif value is not None:
                words.append(f"{option}={value}")
        return words

    def ranks_of(self, args: argparse.Namespace) -> int:
        return getattr(args, "ranks", self.ranks)


def device_of(args: argparse.Namespace) -> torch.device:
    """Where a worker puts its models and batches: with ``--device cuda`` the GPU ``autodist.init`` pinned this
    rank to (several ranks share one where there are fewer GPUs: gloo on CUDA tensors, as tests/gpu does),
    otherwise the CPU."""
    if getattr(args, "device", "cpu") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device")
    import autodist

    return autodist.init().device


def some_of(choices: list[str]) -> Callable[[str], list[str]]:
    """An option's type: a comma-separated list of some of ``choices`` (``--only mlp,tfm2``), an error naming
    them otherwise."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return names
    return parse


def worker_command(script: str, argv: list[str], flag: str = "--worker") -> list[str]:
    """``script`` as one of its own workers: what a launcher starts on every rank."""
    return [script, flag, *argv]


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {})}


def torchrun(script: str, ranks: int, argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run ``script --worker ARGV`` on ``ranks`` local processes through torchrun; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               *worker_command(script, argv)]
    return subprocess.run(command, env=_environment(env), check=False).returncode


def solo(script: str, argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run ``script --solo ARGV`` in one process with no launcher; its exit status."""
    return subprocess.run([sys.executable, *worker_command(script, argv, "--solo")], env=_environment(env),
                          check=False).returncode


def mpirun(script: str, ranks: int, argv: list[str], env: Mapping[str, str] | None = None,
           timeout: float = 600) -> list[int]:
    """Run ``script --worker ARGV`` on ``ranks`` local processes started as Open MPI's mpirun starts them
    (its ``OMPI_COMM_WORLD_*`` variables, the rendezvous on a free port), not through torchrun, which
    stops every rank when one dies; every rank's exit status."""
    base = {k: v for k, v in _environment(env).items()
            if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}  # no launch of the caller's
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base["MASTER_PORT"] = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, *worker_command(script, argv)],
                              env=base | {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(ranks),
                                          "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                                          "OMPI_COMM_WORLD_LOCAL_SIZE": str(ranks)})
             for r in range(ranks)]
    return [p.wait(timeout=timeout) for p in procs]


def run(parser: Parser, args: argparse.Namespace, worker: Run, *, solo_part: Run | None = None,
        launch: Callable[[Parser, argparse.Namespace], int] | None = None,
        env: Mapping[str, str] | None = None) -> int:
    """This process's part: the worker (``--worker``), the single-process part (``--solo``), or, as typed,
    the launch: ``launch(parser, args)`` where given, else the workers on the ranks through torchrun, then the
    single-process part where there is one. The exit status."""
    part = worker if args.worker else solo_part if getattr(args, "solo", False) else None
    if part is not None:
        torch.set_num_threads(getattr(args, "threads", 1))
        part(args)
        return 0
    if launch is not None:
        return launch(parser, args)
    argv = parser.forwarded(args)
    code = torchrun(parser.script, parser.ranks_of(args), argv, env)
    if code == 0 and solo_part is not None:
        code = solo(parser.script, argv, env)
    return code
