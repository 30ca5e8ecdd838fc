#!/usr/bin/env bash
# The main job: set up, then data-parallel training on 2 processes through the real launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/autodist run -n 2 examples/digits_dp.py "$@"
