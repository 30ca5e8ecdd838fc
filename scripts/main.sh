#!/usr/bin/env bash
# The main job: set up, then the CIFAR example on 2 processes through the real launcher
# (on scikit-learn's digits when CIFAR-10 is not in ./data; the first log line says which).
# A leading -n N (or --nproc N) sets the number of processes; every other argument goes to the script:
#   bash scripts/main.sh -n 4 --mode hybrid --epochs 1
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=2
case "${1:-}" in
    -n|--nproc) nproc="${2:?-n needs a number of processes, e.g. -n 4}"; shift 2 ;;
    -n[0-9]*) nproc="${1#-n}"; shift ;;
    --nproc=*|-n=*) nproc="${1#*=}"; shift ;;
esac
bash scripts/setup.sh
exec .venv/bin/autodist run -n "$nproc" examples/cifar/train.py "$@"
