#!/usr/bin/env bash
# The GPU benchmarks of `zfctl bench`, for a machine with one CUDA GPU (run from any folder):
#
#   scripts/bench_zenflow_gpu.sh [all|reference|llama] [OUT_DIR]
#   BATCHES=4 scripts/bench_zenflow_gpu.sh llama OUT_DIR      # one batch size of the llama part
#
# OUT_DIR defaults to bench-results/<date-time> (git-ignored). `reference` and `llama` with one
# batch size each fit in a 10-minute slot on an H100 (estimated ~2 and ~5 minutes); `llama` with
# both batch sizes and `all` do not. scripts/gpu_check.py runs them one batch size at a time.
#
# 1. The reference benchmark's grid (DeepSpeedExamples benchmark/run_benchmark.sh): 4 x
#    Linear(4096, 4096) + bias in bf16, one sample per step; topk 0.1/0.2 x interval 2/4 x
#    overlap on/off x pin on/off = 16 configurations, plus our zero-offload and off baselines.
#    ~67M params: fast, and it isolates the optimizer path from model compute.
# 2. A ~1B-parameter Llama (the llama3.2-1b preset's sizes, random init, bf16, sequences of 1024
#    tokens, batch 1 and 4; BATCHES="1 4" picks them): the ZenFlow presets `paper` and `default`
#    (the latter with host and with device accumulation) against `off` and `zero-offload`, which
#    run once per batch, with `paper` (--baselines leaves them out of the other two runs). The
#    bench's baselines are those presets: off = topk 1 (AdamW on the device), zero-offload =
#    topk 0, update every step, no overlap, pinned. These runs are what scripts/gpu_check.py
#    reads for its acceptance ratios (file names llama-1b-b<batch>-<preset>.json).
#    The preset's `arch` gives hidden 2048, 16 layers, 32 heads (8 KV heads), vocab 128256, MLP
#    8192, tied embeddings: 1.24B params. Host RAM: 16 B/param of offloaded fp32 state (~20 GB);
#    GPU: 2 B/param weights + grads, plus 12 B/param for `off`'s fp32 master and moments (~20 GB).
#
# Each run writes a table to the log and JSON (every timed step), CSV and, when matplotlib is
# installed, a PNG plot into OUT_DIR. Timing uses CUDA events with one synchronisation per timed
# window; warm-up excluded. A run that fails is reported at the end (exit 1); the others still run.
#
# PY (default .venv/bin/python, else python3) runs `PY -m zfctl`; ZFCTL=path/to/zfctl overrides.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
if [ -n "${ZFCTL:-}" ]; then ZF=("$ZFCTL"); else ZF=("$PY" -m zfctl); fi
PART=${1:-all}
OUT=${2:-bench-results/$(date +%Y%m%d-%H%M%S)}
BATCHES=${BATCHES:-1 4}
case "$PART" in all|reference|llama) ;; *) echo "usage: $0 [all|reference|llama] [OUT_DIR]" >&2; exit 2;; esac
for b in $BATCHES; do
  case "$b" in *[!0-9]*|0*) echo "BATCHES=\"$BATCHES\": give positive integers, e.g. BATCHES=\"1 4\"" >&2; exit 2;; esac
done
mkdir -p "$OUT"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "this script needs a CUDA GPU (torch.cuda.is_available() is False)")'
PLOT=()
if "$PY" -c 'import matplotlib' 2>/dev/null; then PLOT=(--plot); fi

{
  echo "# $(date -Is) $(git rev-parse --short HEAD 2>/dev/null || echo unknown-commit)"
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version \
    --format=csv 2>/dev/null || true
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))' || true
  "${ZF[@]}" doctor 2>/dev/null || true
} | tee "$OUT/env.txt"

FAILED=()
run() {  # run NAME ARGS...: one benchmark, its log and its files under OUT
  local name=$1; shift
  local files=(--json "$OUT/$name.json" --csv "$OUT/$name.csv")
  if [ ${#PLOT[@]} -gt 0 ]; then files+=(--plot "$OUT/$name.png"); fi
  echo "== $name: zfctl bench $*" | tee "$OUT/$name.log"
  if ! COLUMNS=200 "${ZF[@]}" bench "$@" "${files[@]}" --force 2>&1 | tee -a "$OUT/$name.log"; then
    FAILED+=("$name")
  fi
}

if [ "$PART" != llama ]; then
run reference-grid --hidden-dim 4096 --nlayers 4 --dtype bf16 \
  --topk 0.1,0.2 --interval 2,4 --overlap on,off --pin on,off \
  --warmup 8 --iterations 5 --trials 3
fi

if [ "$PART" != reference ]; then
# 8 warm-up steps (two intervals: the first CPU updates and the allocator settle), then 5 intervals
# of 4 steps timed, twice on a fresh model: 40 timed steps per configuration.
LLAMA=(--model llama3.2-1b --seq-len 1024 --dtype bf16 --topk 0.1 --interval 4 --overlap on --pin on
       --warmup 8 --iterations 5 --trials 2)
for b in $BATCHES; do
  # paper accumulates on the host, as DeepSpeed's ZenFlow does (the preset leaves it to `auto`).
  run "llama-1b-b$b-paper" "${LLAMA[@]}" --batch "$b" --zenflow paper --accumulate host
  run "llama-1b-b$b-default-host" "${LLAMA[@]}" --batch "$b" --zenflow default --accumulate host --baselines none
  run "llama-1b-b$b-default-device" "${LLAMA[@]}" --batch "$b" --zenflow default --accumulate device \
    --baselines none
done
fi

echo "results in $OUT"
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed: ${FAILED[*]} (see their .log files)" >&2; exit 1; fi
