#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the tests: the whole suite, or with --quick the quick tier (every test not
# marked slow: each subsystem at least once on real processes, the front page's code). Other arguments go to
# pytest: bash scripts/test.sh --quick tests/sharded -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode for autodist and the tests' helpers, written once: every process the suite starts imports them, and
# where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE) each one compiled them again (0.36 s
# of CPU for autodist's modules, in each rank of each job). Only what changed since the last run is compiled.
.venv/bin/python -m compileall -q autodist tests examples benchmarks > /dev/null
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q -m "not slow" "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
