"""``python -m autodist ...`` is the ``autodist`` command."""
import sys

from autodist.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
