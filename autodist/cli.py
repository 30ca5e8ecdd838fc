"""The ``autodist`` command: ``autodist run`` (launch) and ``autodist explain`` (the model-parallel plan)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

_USAGE = """usage: autodist run -n N [torchrun options] script.py [script args]
       autodist explain MODULE:NAME --mp K [--batch-size B] [--layers a,b]

run      launches N processes of script.py on this machine through torchrun
         (torch.distributed.run --standalone: a free port on localhost).
         Multi-node options (--nnodes, --node-rank, --rdzv-endpoint,
         --master-addr, ...) pass through to torchrun unchanged.
explain  prints how parallelize(model, mp=K) would split the model NAME (an
         nn.Module, or a callable returning one) of the importable MODULE.

examples: autodist run -n 2 examples/cifar/train.py --epochs 3
          autodist explain mypackage.models:build_model --mp 2 --batch-size 128
"""

# Any of these means the user set up the rendezvous; otherwise run standalone on this machine.
_RENDEZVOUS_OPTIONS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master-addr", "--master_addr",
                       "--master-port", "--master_port", "--standalone")


def torchrun_args(argv: Sequence[str]) -> list[str]:
    """Translate ``run``'s arguments into torchrun's.

    Example:
        >>> torchrun_args(["-n", "2", "train.py", "--lr", "0.1"])
        ['--standalone', '--nproc-per-node', '2', 'train.py', '--lr', '0.1']
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.add_argument("-n", "--nproc", dest="nproc_per_node", help="processes on this node")
    args = parser.parse_args(list(argv))  # validates; the script and its arguments are found here
    if not (args.module or args.no_python or os.path.isfile(args.training_script)):
        raise SystemExit(f"autodist run: no such script {args.training_script!r}")
    script_at = len(argv) - len(args.training_script_args) - 1
    options = list(argv[:script_at])
    out: list[str] = []
    i = 0
    while i < len(options):
        opt = options[i]
        if opt in ("-n", "--nproc"):
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
    if not any(o.startswith(_RENDEZVOUS_OPTIONS) for o in options):
        out.insert(0, "--standalone")
    return out + list(argv[script_at:])


def explain(argv: Sequence[str]) -> int:
    """``autodist explain MODULE:NAME --mp K``: print the plan of the model found there."""
    parser = argparse.ArgumentParser(prog="autodist explain", description="print the model-parallel plan")
    parser.add_argument("target", help="MODULE:NAME, NAME an nn.Module or a callable returning one")
    parser.add_argument("--mp", type=int, required=True, help="model-parallel degree")
    parser.add_argument("--batch-size", type=int, default=None, help="rows through each Linear per step (batch x seq for 3-D inputs), for the bytes column")
    parser.add_argument("--layers", default="all", help="comma-separated Linear names to split (default: all)")
    args = parser.parse_args(list(argv))
    module_name, _, attr = args.target.partition(":")
    if not module_name or not attr:
        parser.error(f"target must look like MODULE:NAME, got {args.target!r}")
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current folder are found
    found = getattr(importlib.import_module(module_name), attr)
    from torch import nn

    from autodist.rewrite import explain as plan_of

    model = found if isinstance(found, nn.Module) else found()

    layers = "all" if args.layers == "all" else args.layers.split(",")
    print(plan_of(model, mp=args.mp, mp_layers=layers, batch_size=args.batch_size))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autodist`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "explain":
        return explain(rest)
    if command != "run":
        print(f"autodist: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    if not rest or rest[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if rest else 2
    # Restarted workers must not reuse the dead attempt's store (torch's shared rendezvous TCP store hands
    # them stale peer addresses: "connectFullMesh ... Connection refused" or a hang in init_process_group).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun in place of this process: its exit status, signals and output are the user's.
    launch = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(rest)]
    os.execv(sys.executable, launch)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
