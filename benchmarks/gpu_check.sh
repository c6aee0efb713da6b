#!/usr/bin/env bash
# GPU check for kvdiv on one CUDA device, under 8 minutes, with no network.
#
#   make gpu-kit                       # where the package registry is reachable: .gpu-kit/
#   bash benchmarks/gpu_check.sh       # on the GPU machine, with .gpu-kit/ beside the checkout
#   bash benchmarks/gpu_check.sh --dry-run   # every step on the CPU with tiny models (no kit)
#
# Steps (benchmarks/gpu_check.py does b-g; each step has a time limit, 7 min 40 s in all):
#   0. install the kit's wheels into /tmp/kvdiv-site on top of the machine's torch; the
#      checkout first on PYTHONPATH; the embedded tokenizer from the kit;
#      no CUDA visible to torch: exit 1 (unless --dry-run);
#   a. the GPU-marked tests; any skip or failure fails the check;
#   b. the control `full` exactly 0: a bf16 residual study through kvdiv serve/collect/pack
#      with 4 grouped candidates plus the control;
#   c. coupled vs residual occurrence on the same documents (|z| < 4.5);
#   d. the memory estimate against torch's measured peak, per mechanism;
#   e-g. continuous batching of 8 residual requests (T = 256, prompts up to 4k) on random
#      Llama-3.1-8B- and Qwen2.5-7B-shaped models (128k and 152k vocabularies): the step
#      against its floor (fails below MIN_FLOOR_FRACTION), the memory estimate against the
#      peak, the controls' TV exactly 0, and a per-step breakdown;
#   then what the float32 logits cost against a bf16 head (benchmarks/bench_logits.py; its log).
# Prints one table and writes it to $OUT/gpu_check.md ($OUT set) or runs/gpu_check/.
# PYTHON picks the interpreter (default python3).
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then DEST=$OUT; else DEST=runs/gpu_check; fi
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
# models, traces and caches stay outside $OUT (large); logs are copied next to the table
WORK=${KVDIV_GPU_WORK:-${TMPDIR:-/tmp}/kvdiv-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK"
KIT=$PWD/.gpu-kit
SITE=${KVDIV_SITE:-/tmp/kvdiv-site}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
START=$(date +%s)
DRYFLAG=()
echo "interpreter: $PY ($(command -v "$PY" || echo 'not found'))"

# the machine's own torch decides, before anything is installed; the dry run runs on
# the CPU whatever torch sees, so it skips the probe (one interpreter start and torch import)
if [ "$DRY" = 0 ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "CUDA is not visible to torch ($PY): the GPU check needs a CUDA device (use --dry-run on a CPU)" >&2
    exit 1
  fi
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$WORK/device.txt"
fi

RUNPY=("$PY")
if [ "$DRY" = 1 ]; then
  DRYFLAG=(--dry-run)
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "dry run: tiny models on the CPU; the kit is not used"
  # Every python below is a child forked from one interpreter that imported the stack once
  # (benchmarks/fork_server.py): on a CPU each step's imports cost more than its work. The
  # steps keep their command lines, limits and logs; the real check starts each afresh.
  SOCK=$(mktemp -u "${TMPDIR:-/tmp}/kvdiv-fork.XXXXXX")   # short: a socket path has at most 107 bytes
  "$PY" benchmarks/fork_server.py serve "$SOCK" torch transformers kvpress gen_service.engine gen_service.api.cli \
    uvicorn httpx collector.collect divstats kvdiv.cli pytest </dev/null >"$WORK/fork-server.log" 2>&1 &
  FORK_PID=$!
  trap 'kill "$FORK_PID" 2>/dev/null; rm -f "$SOCK"' EXIT
  for _ in $(seq 600); do [ -S "$SOCK" ] || ! kill -0 "$FORK_PID" 2>/dev/null && break; sleep 0.2; done
  if [ ! -S "$SOCK" ]; then
    echo "the dry run's fork server did not start:" >&2; cat "$WORK/fork-server.log" >&2; exit 1
  fi
  RUNPY=("$PY" benchmarks/fork_server.py run "$SOCK")
  export KVDIV_FORK_SERVER=$SOCK   # gpu_check.py starts its `kvdiv serve` through it too
else
  if ! ls "$KIT"/*.whl >/dev/null 2>&1 || [ ! -f "$KIT/tokenizer/tokenizer.json" ]; then
    echo "no kit in $KIT: run 'make gpu-kit' where the package registry is reachable, and carry .gpu-kit" >&2
    exit 1
  fi
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT"/*.whl || exit 1
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export KVDIV_CACHE_DIR=$WORK/cache
fi
"${RUNPY[@]}" - <<'EOF' || exit 1
import sys, importlib.metadata as md
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "tokenizers", "kvpress", "starlette", "uvicorn", "h5netcdf"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
import kvpress, gen_service.engine  # noqa: F401  (fail here, not in every step)
EOF
if [ "$DRY" = 0 ]; then
  "$PY" benchmarks/gpu_check.py tokenizer-cache --out "$WORK" --site "$SITE" --kit "$KIT" || exit 1
fi

step() {  # step NAME SECONDS CMD...: run with a time limit and a log; the table reports it
  local name=$1 limit=$2
  shift 2
  # the dry run checks the code paths, not the speed: on shared CPU cores it gets 4x the time
  [ "$DRY" = 1 ] && limit=$((limit * 4))
  echo "=== $name (limit ${limit}s, $(($(date +%s) - START))s elapsed)"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$WORK/$name.log"
  [ "$rc" -eq 0 ] || echo "!!! $name failed (exit $rc; log $WORK/$name.log)"
}

step gpu-tests 110 "${RUNPY[@]}" -m pytest -q -rs -m gpu -p no:cacheprovider --junitxml="$WORK/gpu-tests.xml" \
  tests/test_shared_prompt_gpu.py tests/test_memory_gpu.py tests/test_engine_host_syncs.py tests/test_stacked_attention.py \
  tests/test_nonfinite_logits.py tests/test_logits.py
step study 110 "${RUNPY[@]}" benchmarks/gpu_check.py study --out "$WORK" "${DRYFLAG[@]}"
step memory 60 "${RUNPY[@]}" benchmarks/gpu_check.py memory --out "$WORK" "${DRYFLAG[@]}"
step serving 150 "${RUNPY[@]}" benchmarks/gpu_check.py serving --out "$WORK" "${DRYFLAG[@]}"
if [ "$DRY" = 1 ]; then
  LOGITS=(--model tiny:llama --device cpu --rows 4 --steps 2 --prompt-tokens 32 --repeats 1 --head-calls 5)
else
  LOGITS=(--model random:llama-8b --device cuda --rows 64 --steps 6 --prompt-tokens 2000 --repeats 1 --head-calls 20)
fi
step logits 30 "${RUNPY[@]}" benchmarks/bench_logits.py --dtype bfloat16 "${LOGITS[@]}"

echo "=== table ($(($(date +%s) - START))s elapsed)"
"${RUNPY[@]}" benchmarks/gpu_check.py table --out "$WORK" --junit "$WORK/gpu-tests.xml" --dest "$DEST/gpu_check.md" \
  "${DRYFLAG[@]}"
STATUS=$?
mkdir -p "$DEST/logs" && cp "$WORK"/*.log "$WORK"/*.json "$WORK"/*.xml "$WORK"/*.txt "$DEST/logs/" 2>/dev/null
echo "=== done in $(($(date +%s) - START))s, logs in $DEST/logs/ (work files in $WORK/), status $STATUS"
exit $STATUS
