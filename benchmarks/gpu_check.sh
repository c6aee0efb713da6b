#!/usr/bin/env bash
# GPU check for gen_service (about 10 minutes at most on one CUDA device; nothing to download).
#
#   1. the GPU-marked tests (tests/test_shared_prompt_gpu.py): bf16 full-vs-full TV = 0,
#      cascade attention and shared-prompt traces equal to the plain path, coupled and
#      residual traces agreeing through divstats;
#   2. benchmarks/bench_service.py on random:llama-1b and on the Llama-3.1-8B-shaped
#      random:llama-8b in bf16: row-steps/s and the fraction of the memory-bandwidth floor;
#   3. benchmarks/bench_shared_prompt.py on random:llama-1b: shared prompt vs per-row copies;
#   4. benchmarks/bench_logits.py on random:llama-8b in bf16: what the float32 logits cost
#      (bf16 head vs cached float32 head vs per-step cast) and how far bf16 logits are off.
#
# Usage: benchmarks/gpu_check.sh [OUTDIR]     (PYTHON=... to pick the interpreter;
#        BANDWIDTH=4800 to give the device's GB/s instead of measuring a copy)
# Without a CUDA device it runs what can run (the GPU tests then skip) and says so.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-${OUT:-${TMPDIR:-/tmp}/kvdiv-gpu-check}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
STATUS=0
BW=()
if [ -n "${BANDWIDTH:-}" ]; then BW=(--bandwidth "$BANDWIDTH"); fi

step() {  # step NAME SECONDS CMD...: run with a time limit, log, and keep going
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, $(($(date +%s) - START))s elapsed)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "!!! $name failed (exit $rc)"
    STATUS=1
  fi
}

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  HAVE_CUDA=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt"
else
  HAVE_CUDA=0
  echo "no CUDA device: the GPU tests skip and the GPU benchmarks are not run"
fi

step gpu-tests 200 "$PY" -m pytest -q -rA -s -m gpu -p no:cacheprovider tests/test_shared_prompt_gpu.py tests/test_memory_gpu.py

if [ "$HAVE_CUDA" = 1 ]; then
  step bench-llama-1b 90 "$PY" benchmarks/bench_service.py --model random:llama-1b --device cuda \
    --rows 64 --steps 16 --request-steps 32 --prompt-tokens 2000 --skip-generate "${BW[@]}"
  step bench-llama-8b 120 "$PY" benchmarks/bench_service.py --model random:llama-8b --device cuda \
    --rows 64 --steps 16 --request-steps 32 --prompt-tokens 2000 --skip-generate "${BW[@]}"
  step shared-vs-copies-1b 60 "$PY" benchmarks/bench_shared_prompt.py --model random:llama-1b --device cuda \
    --rows 64 256 --steps 32 --prompt-tokens 2000 --repeats 1 --no-requests
  step logits-fp32-8b 150 "$PY" benchmarks/bench_logits.py --model random:llama-8b --device cuda \
    --dtype bfloat16 --rows 64 --steps 16 --prompt-tokens 2000 --repeats 3
  echo "=== summary"
  grep -h -E "^model=|coupled row-steps/s|bandwidth floor" "$OUT"/bench-*.log
  grep -h -A3 "copies rs/s" "$OUT"/shared-vs-copies-1b.log
  grep -h -E '"(step_ms|median_paired_time_ratio|max_abs_dlogit|mean_tv|max_tv)"' "$OUT"/logits-fp32-8b.log
fi
echo "=== done in $(($(date +%s) - START))s, logs in $OUT/, status $STATUS"
exit $STATUS
