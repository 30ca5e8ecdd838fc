#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the tests: the whole suite, or with --quick the quick tier (every test not
# marked slow: each subsystem at least once on real processes, the front page's code). Other arguments go to
# pytest: bash scripts/test.sh --quick tests/sharded -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q -m "not slow" "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
