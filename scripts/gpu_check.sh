#!/usr/bin/env bash
# Everything that needs CUDA, in one call of at most 8 minutes (its steps' limits add up to that): run it first
# whenever a GPU is at hand.
#   1. tests/gpu: several processes on one GPU (gloo on CUDA tensors), NCCL where there are two GPUs, and every
#      layout on CUDA against one process: dp, each shard= level, mp, pp, checkpoint=True, plan="auto" (its
#      budget from the GPU's free memory, shared by the ranks on it), checkpoints;
#   2. the short forms of bench_dp.py, bench_sharded.py, bench_mp.py and bench_coupled.py with --device cuda,
#      against DDP, FSDP2, torch's tensor parallelism and DDP with SyncBatchNorm (bench_sharded and bench_mp
#      where there are two GPUs or more: their peers need one per rank).
# Every step's output goes to gpu-check.log and the benchmarks' tables to gpu-figures.md, in GPU_CHECK_OUT
# (default gpu-check/); the last lines say which steps failed, and the status is non-zero if one did. Where
# there is no CUDA device it says so in one line and exits 0, after checking that the CUDA tests are collected
# (a test that fails to import fails here, so they cannot rot unnoticed).
#   PYTHON         the interpreter with a CUDA build of torch (default .venv/bin/python where it exists, else
#                  python3); autodist is taken from this checkout (PYTHONPATH), installed or not
#   GPU_CHECK_OUT  where the log and the figures go
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    if ! listed=$("$PY" -m pytest -q --collect-only -p no:cacheprovider tests/gpu 2>&1); then
        echo "$listed"
        echo "gpu_check: the CUDA tests (tests/gpu) do not collect: fix them before a GPU is at hand" >&2
        exit 1
    fi
    echo "gpu_check: no CUDA device here, nothing run; the $(grep -c '::' <<<"$listed") CUDA tests of tests/gpu" \
         "are collected and run where there is one"
    exit 0
fi

out="${GPU_CHECK_OUT:-gpu-check}"
mkdir -p "$out"
log="$out/gpu-check.log" figures="$out/gpu-figures.md"
: >"$log"
{
    echo "# GPU check, $(date -u +%Y-%m-%d)"
    echo
    "$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, ' + ', '.join(
        torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
} | tee "$figures"
failed=()

step() {  # step NAME SECONDS COMMAND...: run it, its output to the log (and the screen), record a failure
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$log"
    local start=$SECONDS
    if timeout "$limit" "$@" 2>&1 | tee -a "$log"; then
        echo "== $name: passed in $((SECONDS - start)) s" | tee -a "$log"
    else
        echo "== $name: FAILED after $((SECONDS - start)) s" | tee -a "$log"
        failed+=("$name")
    fi
}

bench() {  # bench NAME SECONDS COMMAND...: a step whose printed table goes to the figures too
    local name="$1"
    step "$@"
    { echo; echo "## $name"; echo; echo '```text'
      sed -n "/^== $name: /,/^== $name: \(passed\|FAILED\)/p" "$log" | sed '1d;$d' | tail -40
      echo '```'; } >>"$figures"
}

step "tests/gpu" 185 "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests/gpu
bench "bench_dp" 75 "$PY" benchmarks/bench_dp.py --device cuda --steps 5 --rounds 6 --warmup 3
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    bench "bench_sharded" 105 "$PY" benchmarks/bench_sharded.py --device cuda --steps 3 --rounds 4 --warmup 2
    bench "bench_mp" 75 "$PY" benchmarks/bench_mp.py --device cuda --steps 5 --rounds 6 --warmup 3
else  # their peers need NCCL, one GPU per rank: over gloo on one shared GPU torch's TP crashed (a segmentation
      # fault in its functional all-reduce, torch 2.11) and the FSDP2 run printed nothing in 105 s
    echo "== bench_sharded, bench_mp: not run on $gpus GPU (FSDP2 and torch's TP, their peers, need a GPU per rank)" \
        | tee -a "$log" "$figures"
fi
bench "bench_coupled" 40 "$PY" benchmarks/bench_coupled.py --device cuda --steps 3 --rounds 4 --warmup 2

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: every step passed; figures in $figures, the whole output in $log"
else
    echo "gpu_check: FAILED: ${failed[*]}; the whole output in $log" >&2
    exit 1
fi
