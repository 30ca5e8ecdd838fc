"""cli: the ``autodist`` command (``run``, ``explain``, ``--version``; also ``python -m autodist``) - torchrun
as a supervised child, each rank's lines labelled with its rank, each rank's error recorded, the one-line failure
summary, ``--keep-going`` ranks.
May import: everything (it is the library's user). Entry point: :func:`main` (the console script).
"""
from autodist.cli.command import main

__all__ = ["main"]
