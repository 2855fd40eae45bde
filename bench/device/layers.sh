#!/usr/bin/env bash
# N V4-Flash layers on one GPU (cap ~120 s): CUDA correctness (bf16 drift bound, decode graphs, prefill
# paths at Flash width), `moemesh bench layers` (decode B = 1/8/64, prefill 2K/8K, against the floor),
# and where a B = 1 decode step and the 8K prefill spend their device time (`moemesh bench layers-profile`).
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
set -u
start=$(date +%s)
stamp() { echo "--- layers: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
quiet() { grep --line-buffered -v -i "warn\|debug\|USDT"; }

stamp "CUDA tests"
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_quantized_cuda.py tests/test_kernels_prefill_paths.py \
  -k "model or decode_step or cuda_flash" 2>&1 | quiet | tail -n 20

stamp "bench.layers: decode B=1,8,64 + prefill 2K,8K (defaults)"
timeout 40 python3 -m moemesh.bench.layers --no-transformers --batch 1,8,64 --prefill 2048,8192 --steps 10 \
  --out-dir "$RESULTS_DIR" 2>&1 | quiet

stamp "prefill 8K profile"
timeout 18 python3 -m moemesh.bench.layers_profile --prefill 8192 --steps 2 --top 20 2>&1 | quiet

stamp "decode B=1 profile (eager steps: kernels per step and their device time)"
timeout 18 python3 -m moemesh.bench.layers_profile --batch 1 --steps 3 --top 25 2>&1 | quiet
stamp "done"
