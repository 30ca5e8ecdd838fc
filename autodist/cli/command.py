"""The ``autodist`` command (also ``python -m autodist``): ``run`` launches, ``explain`` prints a plan.

A mistake on the command line is one line on stderr and exit status 2, never a
traceback. How a launched job is supervised (the child launcher, the failure
summary, Ctrl-C) is in :mod:`autodist.cli.launch`.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import logging
import os
import sys
import tempfile
from typing import Any, NoReturn, Sequence

from autodist.cli.keep_going import Node
from autodist.cli.launch import launch, python_command, run_script, supervise
from autodist.cli.output import Output, ranks_of

_USAGE = """usage: autodist run [-n N] [torchrun options] script.py [script args]
       autodist explain MODULE:NAME --mp K [--batch-size B] [--layers a,b]
       autodist explain MODULE:NAME --pp K [--mp K]
       autodist explain PLAN.json
       autodist --version

run      launches N processes of script.py through torchrun, on this machine
         unless torchrun's multi-node options say otherwise; a failed job ends
         with one line naming the rank, how it ended and its error's last line
         (autodist run --help for the options).
explain  prints how parallelize(model, mp=K) would split the model NAME (an
         nn.Module, or a callable returning one) of the importable MODULE (with
         --pp K: the pipeline stages it would cut); or the table of a plan
         saved by autodist.plan(...).save(PLAN.json).

examples: autodist run -n 2 examples/cifar/train.py --epochs 3
          autodist explain mypackage.models:build_model --mp 2 --batch-size 128
          autodist explain plan.json
"""

_RUN_HELP = """usage: autodist run [-n N] [output options] [torchrun options] script.py [script args]

Runs N processes of script.py through torchrun. Arguments after the script go
to the script. If the job fails, the last line names the rank that failed, how
(exit code or signal) and its error's last line; the exit status is that
rank's. Ctrl-C stops every rank and exits with status 130.

  -n N, --nproc N        processes on this node (torchrun's --nproc-per-node)

Each line a rank prints comes out whole, labelled with its rank (global, from
0): "[rank1]: loss 0.25". A job of one process prints as python would.
  --show-ranks R[,R..]   print the lines of these ranks only (e.g. 0); a rank
                         that fails still shows its last lines on stderr before
                         the line naming it
  --raw-output           no labels: the ranks write to this terminal directly,
                         as under torchrun (lines of several ranks may mix)

Every torchrun option passes through unchanged (python -m torch.distributed.run
--help lists them all); the most useful:
  --nnodes N             machines taking part (default 1)
  --node-rank R          this machine's index, 0..N-1 (with --master-addr and
                         --master-port: the machine of node rank 0 and a port)
  --rdzv-endpoint H:P    instead of the three above, where the machines meet,
                         with --rdzv-backend c10d --rdzv-id JOB on every machine
  --max-restarts K       restart every rank up to K times after a failure
  --log-dir DIR          also keep each rank's output in files under DIR
                         (with --raw-output, add --tee 3)
  --keep-going           (autodist's, with -n and the output options only)
                         start the ranks without torchrun, so that the others
                         finish when one is lost: for autodist.Downpour /
                         autodist.EASGD training
  --elastic              (autodist's, as --keep-going; across machines also with
                         --nnodes, --node-rank and --rdzv-endpoint) the ranks
                         left after one is lost go on with the same training:
                         the step in flight is abandoned, every global batch is
                         split over them (plain data parallelism;
                         docs/elastic.md)

On one machine (none of --nnodes, --node-rank, --rdzv-*, --master-*,
--standalone given) nothing listens beyond 127.0.0.1.

examples: autodist run -n 2 train.py --epochs 3
          autodist run -n 4 --show-ranks 0 train.py
          autodist run --nnodes 2 --node-rank 0 --master-addr node0 \\
                       --master-port 29500 -n 4 train.py    (node1: --node-rank 1)
"""

# Any of these means the user set up the rendezvous; otherwise the job runs on this machine only.
_RENDEZVOUS_OPTIONS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master-addr", "--master_addr",
                       "--master-port", "--master_port", "--standalone")
# torchrun also takes its options from PET_* variables.
_RENDEZVOUS_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_MASTER_ADDR",
                         "PET_MASTER_PORT", "PET_STANDALONE")


class UsageError(Exception):
    """A mistake on the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose complaints are one line (what was wrong, where to look) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


# -- run -------------------------------------------------------------------------------------------

def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "autodist run"

    def error(message: str) -> NoReturn:
        raise UsageError(f"{message} (see autodist run --help)")

    parser.error = error  # type: ignore[method-assign]
    parser.add_argument("-n", "--nproc", dest="nproc_per_node", help="processes on this node")
    parser.add_argument("--show-ranks", default=None, help="print only these ranks' lines (e.g. 0 or 0,3)")
    parser.add_argument("--raw-output", action="store_true", help="the ranks' lines unlabelled, as they write them")
    return parser


def _single_node(workdir: str) -> list[str]:
    """One machine, nothing listening beyond loopback: the ranks meet in a file, rank 0 on 127.0.0.1."""
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", os.path.join(workdir, "rendezvous"),
            "--rdzv-conf", "store_type=file", "--rdzv-id", "autodist", "--local-addr", "127.0.0.1"]


def _nproc_options(options: Sequence[str]) -> list[str]:
    """``-n N`` / ``--nproc N`` (and ``-nN``, ``-n=N``, ``--nproc=N``) spelled as torchrun's --nproc-per-node."""
    out: list[str] = []
    i = 0
    while i < len(options):
        opt = options[i]
        if opt in ("-n", "--nproc") and i + 1 < len(options):
            out += ["--nproc-per-node", options[i + 1]]
            i += 2
            continue
        if opt.startswith(("-n=", "--nproc=")):
            out += ["--nproc-per-node", opt.split("=", 1)[1]]
        elif opt.startswith("-n") and not opt.startswith("--") and opt[2:].isdigit():  # -n2
            out += ["--nproc-per-node", opt[2:]]
        else:
            out.append(opt)
        i += 1
    return out


def _without_own(options: Sequence[str]) -> list[str]:
    """The options before the script less autodist's own about output (``--show-ranks R``, ``--raw-output``)."""
    out: list[str] = []
    skip = False
    for i, opt in enumerate(options):
        if skip:
            skip = False
        elif opt == "--show-ranks":
            skip = i + 1 < len(options)
        elif opt != "--raw-output" and not opt.startswith("--show-ranks="):
            out.append(opt)
    return out


def output_of(argv: Sequence[str]) -> Output:
    """How ``run``'s arguments ask for the ranks' lines: labelled (the default), the ranks of ``--show-ranks``
    only, or raw with ``--raw-output``; a job known to have one process prints raw (nothing to tell apart).

    Example:
        >>> output_of(["-n", "4", "--show-ranks", "0", "train.py"])
        Output(labelled=True, shown=frozenset({0}))
    """
    args = _torchrun_parser().parse_args(list(argv))
    if args.raw_output and args.show_ranks is not None:
        raise UsageError("--show-ranks picks among labelled lines and --raw-output has none; for raw lines of "
                         "some ranks only, use torchrun's --local-ranks-filter (ranks of this machine)")
    world = None
    if str(args.nproc_per_node).isdigit() and args.nnodes.split(":")[-1] == "1":
        world = int(args.nproc_per_node)
    shown = None
    if args.show_ranks is not None:
        try:
            shown = ranks_of(args.show_ranks)
        except ValueError as error:
            raise UsageError(f"--show-ranks {error}") from None
        if world is not None and max(shown) >= world:
            raise UsageError(f"--show-ranks {args.show_ranks}: this job has {world} rank(s), 0 to {world - 1}")
    if args.raw_output or world == 1:
        return Output(labelled=False)
    return Output(shown=shown)


def torchrun_args(argv: Sequence[str], workdir: str, env: dict[str, str] | None = None) -> list[str]:
    """Translate ``run``'s arguments into torchrun's.

    ``workdir`` is the folder of this run (where the ranks meet on one machine,
    and torchrun's per-rank error files). The script runs inside ``autodist
    _rank`` (see :func:`autodist.cli.launch.run_script`), which records its error
    for the summary.

    Example:
        >>> torchrun_args(["-n", "2", "train.py", "--lr", "0.1"], "/tmp/r", {})[-5:]
        ['_rank', '--loopback-store', 'train.py', '--lr', '0.1']
    """
    env = dict(os.environ) if env is None else env
    args = _torchrun_parser().parse_args(list(argv))  # validates; the script and its arguments are found here
    _check_counts(args.nproc_per_node, args.nnodes)
    output = output_of(argv)
    if not (args.module or args.no_python or os.path.isfile(args.training_script)):
        raise UsageError(f"no such script {args.training_script!r} (run it from the folder the path is relative "
                         f"to, or give its full path)")
    script_at = len(argv) - len(args.training_script_args) - 1
    options = _without_own(_nproc_options(argv[:script_at]))
    out: list[str] = []
    one_machine = not any(o.startswith(_RENDEZVOUS_OPTIONS) for o in options) and \
        not any(v in env for v in _RENDEZVOUS_VARIABLES)
    if one_machine:
        out += _single_node(workdir)  # first: an option the user gave later (--local-addr) wins
    if not any(o.startswith(("--log-dir", "--log_dir", "--redirects", "--tee", "-r", "-t")) for o in options):
        out += ["--log-dir", os.path.join(workdir, "logs")]  # removed with the run (torchrun's default is kept)
    out += options
    if output.labelled and not any(o.startswith(("--redirects", "--tee", "-r", "-t")) for o in options):
        out += ["--tee", "3"]  # each rank's stdout and stderr into its log files, tailed a labelled line at a time
    if args.module or args.no_python or args.run_path:  # not a Python file autodist can run: as torchrun would
        return out + list(argv[script_at:])
    rank = ["--no-python", *python_command("_rank", unbuffered=True)]  # -u: as torchrun runs python
    return out + rank + (["--loopback-store"] if one_machine else []) + list(argv[script_at:])


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's: a process per CPU, GPU or XPU


def _check_counts(nproc: str, nnodes: str) -> None:
    """The two counts torchrun takes as free text, checked before it reads them (its own error is a traceback
    and exit status 1): ``-n`` a number >= 1 or one of NPROC_WORDS, ``--nnodes`` N or MIN:MAX.

    Example:
        >>> _check_counts("two", "1")
        Traceback (most recent call last):
        UsageError: -n 'two': give a number of processes on this node (e.g. -n 2), or one of auto, cpu, gpu, xpu
    """
    if not (nproc in NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1)):
        raise UsageError(f"-n {nproc!r}: give a number of processes on this node (e.g. -n 2), or one of "
                         f"{', '.join(NPROC_WORDS)}")
    bounds = nnodes.split(":")
    if len(bounds) > 2 or not all(b.isdigit() and int(b) >= 1 for b in bounds) or int(bounds[0]) > int(bounds[-1]):
        raise UsageError(f"--nnodes {nnodes!r}: give a number of machines (e.g. --nnodes 2), or MIN:MAX for an "
                         f"elastic job (e.g. --nnodes 1:4)")


def _world(torchrun_argv: Sequence[str]) -> int | None:
    """How many ranks the job has, when this machine's options tell (one node, a number of processes)."""
    args = _torchrun_parser().parse_args(list(torchrun_argv))
    if args.nnodes == "1" and str(args.nproc_per_node).isdigit():
        return int(args.nproc_per_node)
    return None


def run(argv: Sequence[str]) -> int:
    """``autodist run``: launch through torchrun, supervised; returns the job's exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_RUN_HELP)
        return 0 if argv else 2
    # Restarted workers must not reuse the dead attempt's store (torch's shared rendezvous TCP store hands
    # them stale peer addresses: "connectFullMesh ... Connection refused" or a hang in init_process_group).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    elastic, argv = _own_flag(list(argv), "--elastic")
    if elastic or "--keep-going" in argv:
        return _keep_going([a for a in argv if a != "--keep-going"], elastic)
    with tempfile.TemporaryDirectory(prefix="autodist-run-") as workdir:
        return supervise(list(argv), workdir)  # the launcher reads the arguments: this process never loads torch


def _launch_job(workdir: str, argv: list[str]) -> int:
    """The launcher child of ``autodist run``: ``run``'s arguments read (torchrun's parser checks them), then
    torchrun; a bad argument is one line and status 2."""
    try:
        torchrun = torchrun_args(argv, workdir)
        output = output_of(argv)
    except UsageError as error:
        print(f"autodist run: {error}", file=sys.stderr, flush=True)
        return 2
    return launch(os.path.join(workdir, "failures.json"), torchrun, output, _world(torchrun))


def _own_flag(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """Whether ``flag`` is among run's options (before the script; after it, it is the script's), and
    ``argv`` without it there."""
    if flag not in argv:
        return False, argv
    at = argv.index(flag)
    rest = argv[:at] + argv[at + 1:]
    try:
        args = _torchrun_parser().parse_args([a for a in rest if a != "--keep-going"])
    except UsageError:
        return False, argv
    script_at = len(rest) - len(args.training_script_args) - 1
    return (True, rest) if at <= script_at else (False, argv)


def _keep_going(argv: list[str], elastic: bool = False) -> int:
    """``autodist run --keep-going -n N script.py``: the ranks outlive a lost peer (see autodist.cli.keep_going);
    ``--elastic``: and plain data parallelism goes on with them (autodist.faults.elastic)."""
    from autodist.cli.keep_going import run_each

    args = _torchrun_parser().parse_args(argv)
    script_at = len(argv) - len(args.training_script_args) - 1
    options, node = _node_options(_without_own(_nproc_options(argv[:script_at])), args) if elastic else \
        (_without_own(_nproc_options(argv[:script_at])), None)
    if len(options) != 2 or options[0] != "--nproc-per-node" or not options[1].isdigit() or int(options[1]) < 1:
        raise UsageError(f"{'--elastic' if elastic else '--keep-going'} starts the ranks of this machine itself, "
                         "without torchrun: it takes "
                         "only -n N (a positive number of processes), --show-ranks and --raw-output before the "
                         f"script{' (and --nnodes, --node-rank, --master-addr, --master-port or --rdzv-endpoint)' if elastic else ''}")
    if not os.path.isfile(args.training_script):
        raise UsageError(f"no such script {args.training_script!r}")
    with tempfile.TemporaryDirectory(prefix="autodist-run-") as workdir:
        return run_each(int(options[1]), [args.training_script, *args.training_script_args], workdir,
                        output_of(argv), elastic, node, int(args.max_restarts) if elastic else 0)


_NODE_OPTIONS = ("--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
                 "--master_port", "--rdzv-endpoint", "--rdzv_endpoint")
_RESTARTS = ("--max-restarts", "--max_restarts")


def _node_options(options: list[str], args: argparse.Namespace) -> tuple[list[str], Node | None]:
    """``options`` less the multi-node ones (and ``--max-restarts``, which --elastic takes too), and the node
    they describe (None on one machine): --elastic across machines, the launcher of node 0 hosting the store at
    the rendezvous address."""
    rest, i, given = [], 0, False
    while i < len(options):
        name = options[i].split("=", 1)[0]
        if name in _NODE_OPTIONS or name in _RESTARTS:
            given = given or name in _NODE_OPTIONS
            i += 1 if "=" in options[i] else 2
        else:
            rest.append(options[i])
            i += 1
    if not given:
        return rest, None
    nodes = str(args.nnodes)
    low, _, high = nodes.partition(":")
    nodes = low if high in ("", low) else nodes  # torchrun's "1:1" (its default) is 1
    if not nodes.isdigit() or int(nodes) < 1:
        raise UsageError(f"--elastic takes a fixed --nnodes N across machines, got {nodes!r}")
    if args.rdzv_endpoint:
        addr, _, port = args.rdzv_endpoint.rpartition(":")
    else:
        addr, port = args.master_addr, str(args.master_port)
    if not addr or not port.isdigit():
        raise UsageError("--elastic across machines needs the rendezvous address: --rdzv-endpoint HOST:PORT, or "
                         "--master-addr HOST --master-port PORT (node 0's machine hosts the store there)")
    if not 0 <= int(args.node_rank) < int(nodes):
        raise UsageError(f"--node-rank {args.node_rank} is not one of the {nodes} nodes (0..{int(nodes) - 1})")
    return rest, Node(int(nodes), int(args.node_rank), addr, int(port))


# -- explain ---------------------------------------------------------------------------------------

def _import(module_name: str) -> Any:
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        stem = os.path.splitext(os.path.basename(module_name))[0]
        raise UsageError(f"{module_name!r} is a file path; give the module's import name instead, e.g. "
                         f"'{stem}:NAME' run from the folder that holds {os.path.basename(module_name)}")
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current folder are found
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise UsageError(f"no module named {error.name!r} (looked in the current folder and on sys.path; "
                             f"run from the folder that holds it or add that folder to PYTHONPATH)") from None
        raise _raised_inside(f"importing {module_name!r}", error) from None
    except Exception as error:  # noqa: BLE001 - the user's module failed: say where, in one line
        raise _raised_inside(f"importing {module_name!r}", error) from None


def _raised_inside(doing: str, error: BaseException) -> UsageError:
    frames = [f for f in inspect.getinnerframes(error.__traceback__, 0)] if error.__traceback__ else []
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return UsageError(f"{doing} raised {type(error).__name__}: {error}{where}")


def _model(target: str) -> Any:
    """The nn.Module named by MODULE:NAME (NAME may be dotted), built if NAME is a callable."""
    from torch import nn

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UsageError(f"target must look like MODULE:NAME (e.g. mypackage.models:build_model), got {target!r}")
    found: Any = _import(module_name)
    for i, part in enumerate(attr.split(".")):
        if not hasattr(found, part):
            where = module_name + "".join("." + p for p in attr.split(".")[:i])
            names = [n for n in dir(found) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UsageError(f"{where!r} has no name {part!r}{hint}")
        found = getattr(found, part)
    if isinstance(found, nn.Module):
        return found
    if not callable(found):
        raise UsageError(f"{target} is a {type(found).__name__}, not an nn.Module or a callable returning one")
    try:
        inspect.signature(found).bind()
    except TypeError as error:
        raise UsageError(f"{target} cannot be called without arguments ({error}); point at a function that "
                         f"builds the model with none") from None
    except ValueError:
        pass  # no signature to read (a builtin): just call it
    try:
        model = found()
    except Exception as error:  # noqa: BLE001 - the user's builder failed: say where, in one line
        raise _raised_inside(f"calling {target}", error) from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}() returned a {type(model).__name__}, not an nn.Module")
    return model


def _saved_plan(path: str) -> int:
    """``autodist explain PLAN.json``: the table of a plan ``autodist.plan`` made and saved."""
    from autodist.planner.plan import ParallelPlan

    try:
        print(ParallelPlan.load(path))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return 0


def explain(argv: Sequence[str]) -> int:
    """``autodist explain MODULE:NAME --mp K``: print the plan of the model found there (``--pp K``: its pipeline
    stages); ``autodist explain PLAN.json``: print a saved plan's table."""
    parser = _Parser(prog="autodist explain", description="print the model-parallel plan, or a saved plan")
    parser.add_argument("target", help="MODULE:NAME, NAME an nn.Module or a callable returning one; or PLAN.json")
    parser.add_argument("--mp", type=int, default=None, help="model-parallel degree (an integer >= 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (an integer >= 1): the blocks each takes, "
                        "balanced by their parameters")
    parser.add_argument("--batch-size", type=int, default=None, help="rows through each Linear per step (batch x seq for 3-D inputs), for the bytes column")
    parser.add_argument("--layers", default="all", help="comma-separated Linear names to split (default: all)")
    args = parser.parse_args(list(argv))
    if args.target.endswith(".json"):
        return _saved_plan(args.target)
    if args.mp is None and args.pp == 1:
        raise UsageError("--mp K or --pp K is needed to explain a model (or give a saved plan: autodist explain "
                         "PLAN.json)")
    if args.pp < 1:
        raise UsageError(f"--pp must be an integer >= 1, got {args.pp}")
    args.mp = 1 if args.mp is None else args.mp
    if args.mp < 1:
        raise UsageError(f"--mp must be an integer >= 1, got {args.mp}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    model = _model(args.target)
    from autodist.api import explain as plan_of

    layers = "all" if args.layers == "all" else [name for name in args.layers.split(",") if name]
    try:
        plan = plan_of(model, mp=args.mp, mp_layers=layers, batch_size=args.batch_size, pp=args.pp)
    except (ValueError, TypeError, NotImplementedError) as error:
        asked = f"--mp {args.mp}" if args.pp == 1 else f"--pp {args.pp}" + (f" --mp {args.mp}" if args.mp > 1 else "")
        raise UsageError(f"{args.target} with {asked}: {error}") from None
    print(plan)
    return 0


# -- the command -----------------------------------------------------------------------------------

def _version() -> str:
    from autodist import __version__

    return f"autodist {__version__}"


def _exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's clean-up: with torch loaded that takes about a second, which a
    supervising process (nothing of the user's runs in it) would add to every job's end."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autodist`` console script and of ``python -m autodist``.

    Args:
        argv: the arguments; None (the process's own command line) also lets ``run`` exit at once.
    """
    if argv is None and sys.argv[1:2] in (["run"], ["_launch"]):
        _exit_now(_main(sys.argv[1:]))
    return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command in ("-V", "--version"):
            print(_version())
            return 0
        if command == "explain":
            return explain(rest)
        if command == "run":
            return run(rest)
        if command == "_rank":  # inside each rank of `autodist run` (see autodist.cli.launch)
            run_script(rest)
            return 0
        if command == "_launch":  # the launcher child of `autodist run`: its folder, then run's arguments
            return _launch_job(rest[0], rest[1:])
        raise UsageError(f"unknown command {command!r}; the commands are run and explain (see autodist --help)")
    except UsageError as error:
        name = f"autodist {command}" if command in ("run", "explain") else "autodist"
        print(f"{name}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
