#!/usr/bin/env bash
# Attention kernels: CUDA correctness tests, then kernel timings (`moemesh bench kernels-attention`), then the
# layer figure (`moemesh bench layers`: decode B = 1/8/64, prefill 2K/8K).
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
# ATTN_CAP_S: the cap run_all gives this script (default 240 s); below 200 s a quick sweep only.
set -u
cap="${ATTN_CAP_S:-240}"
start=$(date +%s)
left() { echo $(( cap - ($(date +%s) - start) - 5 )); }
stamp() { echo "--- attention-kernels: $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv
stamp "CUDA tests"
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention_cuda.py 2>&1 | tail -n 40
stamp "kernel bench (left $(left)s)"
if [ "$cap" -lt 200 ]; then
  timeout -k 5 "$(left)" python3 -m moemesh.bench.kernels_attention --out-dir "$RESULTS_DIR" --quick --batch 64,8,1 \
    --prefill 8192 --profile
else
  timeout -k 5 140 python3 -m moemesh.bench.kernels_attention --out-dir "$RESULTS_DIR" --profile
  stamp "layer bench (left $(left)s)"
  if [ "$(left)" -gt 30 ]; then
    timeout -k 5 "$(left)" python3 -m moemesh.bench.layers --no-transformers --batch 1,8,64 --prefill 2048,8192 --prefill-reps 2 \
      --out-dir "$RESULTS_DIR"
  fi
fi
stamp "done"
