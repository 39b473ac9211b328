#!/usr/bin/env bash
# The GPU benchmarks of `zfctl bench`, for a machine with one CUDA GPU (run from any folder):
#
#   scripts/bench_zenflow_gpu.sh [all|reference|llama] [OUT_DIR]
#
# OUT_DIR defaults to bench-results/<date-time> (git-ignored). `reference` and `llama` run one
# part each (each fits in a 10-minute slot on an H100; `all` runs both).
#
# 1. The reference benchmark's grid (DeepSpeedExamples benchmark/run_benchmark.sh): 4 x
#    Linear(4096, 4096) + bias in bf16, one sample per step; topk 0.1/0.2 x interval 2/4 x
#    overlap on/off x pin on/off = 16 configurations, plus our zero-offload and off baselines.
#    ~67M params: fast, and it isolates the optimizer path from model compute.
# 2. A ~1B-parameter Llama (the llama3.2-1b preset's sizes, random init, bf16, one sequence of
#    1024 tokens per step): ZenFlow topk 0.1, interval 4, overlap on/off vs zero-offload vs off.
#    The preset's `arch` gives hidden 2048, 16 layers, 32 heads, vocab 128256, MLP 8192; without
#    num_key_value_heads/tie_word_embeddings in it the model has 1.6B params (1.24B with them).
#    Host RAM: 16 B/param of offloaded fp32 state (~26 GB); GPU: 2 B/param weights + grads, plus
#    12 B/param for `off`'s fp32 master and moments (~19 GB).
#
# Each run writes a table to the log and JSON (every timed step), CSV and, when matplotlib is
# installed, a PNG plot into OUT_DIR. Timing uses CUDA events with one synchronisation per timed
# window; 3 trials per configuration, warm-up excluded.
set -euo pipefail
cd "$(dirname "$0")/.."

ZFCTL=${ZFCTL:-.venv/bin/zfctl}
PY=${PY:-.venv/bin/python}
PART=${1:-all}
OUT=${2:-bench-results/$(date +%Y%m%d-%H%M%S)}
case "$PART" in all|reference|llama) ;; *) echo "usage: $0 [all|reference|llama] [OUT_DIR]" >&2; exit 2;; esac
mkdir -p "$OUT"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "this script needs a CUDA GPU (torch.cuda.is_available() is False)")'
PLOT=()
if "$PY" -c 'import matplotlib' 2>/dev/null; then PLOT=(--plot); fi

{
  echo "# $(date -Is) $(git rev-parse --short HEAD 2>/dev/null || echo unknown-commit)"
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version \
    --format=csv 2>/dev/null || true
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))' || true
  "$ZFCTL" doctor 2>/dev/null || true
} | tee "$OUT/env.txt"

run() {  # run NAME ARGS...: one benchmark, its log and its files under OUT
  local name=$1; shift
  local files=(--json "$OUT/$name.json" --csv "$OUT/$name.csv")
  if [ ${#PLOT[@]} -gt 0 ]; then files+=(--plot "$OUT/$name.png"); fi
  echo "== $name: zfctl bench $*" | tee "$OUT/$name.log"
  COLUMNS=200 "$ZFCTL" bench "$@" "${files[@]}" --force 2>&1 | tee -a "$OUT/$name.log"
}

if [ "$PART" != llama ]; then
run reference-grid --hidden-dim 4096 --nlayers 4 --dtype bf16 \
  --topk 0.1,0.2 --interval 2,4 --overlap on,off --pin on,off \
  --warmup 8 --iterations 5 --trials 3
fi

if [ "$PART" != reference ]; then
run llama-1b --model llama3.2-1b --seq-len 1024 --batch 1 --dtype bf16 \
  --topk 0.1 --interval 4 --overlap on,off --pin on \
  --warmup 8 --iterations 5 --trials 3
# The acceptance lines: batch 4, host accumulation (gradients stream during backward) and device
# accumulation (the interval sum on the GPU).
for acc in host device; do
run "llama-1b-b4-$acc" --model llama3.2-1b --seq-len 1024 --batch 4 --dtype bf16 \
  --topk 0.1 --interval 4 --overlap on --pin on --accumulate "$acc" \
  --warmup 8 --iterations 5 --trials 2
done
fi

echo "results in $OUT"
