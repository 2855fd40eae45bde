#!/usr/bin/env bash
# The decode layers read from a full-width checkpoint on disk by the serving loaders (cap ~400 s): writes a
# random V4-Flash checkpoint of LAYERS_CHECKPOINT_LAYERS main layers (default 5: window, window, hash-routed
# CSA, HCA, CSA) under /tmp, then `moemesh bench layers --checkpoint` at B = 1 and 64, kernels profiled, so its
# per-layer and per-kernel ratios can be set beside those of `layer-kernels.sh` (random layers in memory).
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
set -u
start=$(date +%s)
stamp() { echo "--- layers-checkpoint: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
quiet() { grep --line-buffered -v -i "warn\|debug\|USDT"; }
checkpoint=/tmp/moemesh-layers-checkpoint

stamp "make-checkpoint v4-flash, ${LAYERS_CHECKPOINT_LAYERS:-5} layers"
rm -rf "$checkpoint"
timeout 200 python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers "${LAYERS_CHECKPOINT_LAYERS:-5}" \
  --mtp-layers 0 --out "$checkpoint" 2>&1 | tail -n 5
stamp "bench.layers --checkpoint, decode B=1,64"
timeout 200 python3 -m moemesh.bench.layers --checkpoint "$checkpoint" --no-transformers --batch 1,64 --prefill "" \
  --steps 10 --out-dir "$RESULTS_DIR" 2>&1 | quiet | tail -n 40
rm -rf "$checkpoint"
stamp "done"
