"""The ``autodist`` command: ``autodist run -n N [torchrun options] script.py [args]``."""
from __future__ import annotations

import os
import sys
from typing import Sequence

_USAGE = """usage: autodist run -n N [torchrun options] script.py [script args]

Launches N processes of script.py on this machine through torchrun
(torch.distributed.run), meeting on 127.0.0.1 with a free port. Multi-node
options (--nnodes, --node-rank, --rdzv-endpoint, --master-addr, ...) pass
through to torchrun unchanged.

example: autodist run -n 2 examples/cifar/train.py --epochs 3
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
        else:
            out.append(opt)
        i += 1
    if not any(o.startswith(_RENDEZVOUS_OPTIONS) for o in options):
        out.insert(0, "--standalone")
    return out + list(argv[script_at:])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autodist`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "run":
        print(f"autodist: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    if not rest or rest[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if rest else 2
    # torchrun in place of this process: its exit status, signals and output are the user's.
    launch = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(rest)]
    os.execv(sys.executable, launch)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
