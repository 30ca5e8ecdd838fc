#!/usr/bin/env bash
# The main job: set up, then the CIFAR example on 2 processes through the real launcher
# (on scikit-learn's digits when CIFAR-10 is not in ./data; the first log line says which).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/autodist run -n 2 examples/cifar/train.py "$@"
