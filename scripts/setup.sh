#!/usr/bin/env bash
# Create .venv (once) with the CPU build of PyTorch and autodist with its test and example extras.
# The library itself asks only for torch>=2.4; the pin keeps this machine off the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sklearn, pytest, tqdm, matplotlib, transformers, autodist" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test,examples]"
fi
# iproute2 (ip, tc) for the two-host tests (tests/cluster.py): installed only where missing, and only as root.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null) ||
        echo "setup: could not install iproute2; the two-host tests will skip" >&2
fi
