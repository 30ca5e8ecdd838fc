#!/usr/bin/env bash
# Create .venv (once) with PyTorch and autodist with its test and example extras, then say which PyTorch
# it holds. The library itself asks only for torch>=2.4; which build you get is yours to say:
#   AUTODIST_TORCH      the torch requirement (default torch==2.13.0, the version the tests run on)
#   AUTODIST_PIP_ARGS   extra pip options for installing torch, e.g. PyTorch's CPU wheel index:
#                       AUTODIST_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" bash scripts/setup.sh
# Without them pip takes torch from the index it is configured with: on Linux that default build carries
# CUDA (several GB) unless the index serves a CPU wheel. Changing either reinstalls torch on the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH="${AUTODIST_TORCH:-torch==2.13.0}"
PIP_ARGS="${AUTODIST_PIP_ARGS:-}"
wanted="$TORCH $PIP_ARGS"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
before="$(cat .venv/autodist-torch 2>/dev/null || true)"
if [ "$before" != "$wanted" ] ||
        ! .venv/bin/python -c "import torch, sklearn, pytest, tqdm, matplotlib, transformers, accelerate, lightning, datasets, autodist" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    if [ -n "$before" ] && [ "$before" != "$wanted" ]; then  # another build asked for: pip would keep the old one
        .venv/bin/python -m pip uninstall --quiet --yes torch
    fi
    # shellcheck disable=SC2086  # PIP_ARGS is a list of options
    .venv/bin/python -m pip install --quiet $PIP_ARGS "$TORCH"
    .venv/bin/python -m pip install --quiet -e ".[test,examples]"
    echo "$wanted" > .venv/autodist-torch
fi
.venv/bin/python - <<'EOF'
import torch
if torch.version.cuda:
    build = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible"
elif getattr(torch.version, "hip", None):
    build = f"ROCm {torch.version.hip}, {torch.cuda.device_count()} GPU(s) visible"
else:
    build = "CPU only"
print(f"setup: .venv has torch {torch.__version__} ({build})")
EOF
# iproute2 (ip, tc) for the two-host tests (tests/cluster.py): installed only where missing, and only as root.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null) ||
        echo "setup: could not install iproute2; the two-host tests will skip" >&2
fi
