#!/usr/bin/env bash
# Kernels of a decode layer on one GPU (cap ~150 s): `moemesh bench layers` at B = 1 and 64 with each
# piece's CUDA-graph replay profiled (kernels per layer and their device time in the JSON), then the
# per-piece kernel lists of a B = 1 and a B = 64 step (`moemesh bench layers-profile --graphs`).
# LAYER_KERNELS_BATCH (default "1,64") and LAYER_KERNELS_PREFILL (default none, e.g. "8192") widen the run.
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
set -u
start=$(date +%s)
stamp() { echo "--- layer-kernels: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
quiet() { grep --line-buffered -v -i "warn\|debug\|USDT"; }

stamp "bench.layers: decode B=${LAYER_KERNELS_BATCH:-1,64}, prefill ${LAYER_KERNELS_PREFILL:-none}"
python3 -m moemesh.bench.layers --no-transformers --batch "${LAYER_KERNELS_BATCH:-1,64}" \
  --prefill "${LAYER_KERNELS_PREFILL:-}" --steps 10 --out-dir "$RESULTS_DIR" 2>&1 | quiet

for batch in 1 64; do
  stamp "graph replays, B=$batch: kernels per piece"
  python3 -m moemesh.bench.layers_profile --graphs --batch "$batch" --top 60 2>&1 | quiet
done
stamp "done"
