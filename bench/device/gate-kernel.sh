#!/usr/bin/env bash
# The one-launch MoE gate: its CUDA tests at V4-Flash size (Gate's kernel against its torch path, the tie rule,
# a graph replay), then `moemesh bench kernels-fused` for the gate ops against the torch gate and the floor,
# then the 2-layer decode step with the fused glue (which includes the gate).
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set; cap 240 s.
set -u
start=$(date +%s)
stamp() { echo "--- gate-kernel: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
stamp "gate CUDA tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gate.py -k cuda 2>&1 | tail -n 30
stamp "gate ops, kernel against torch (T = 1, 8, 64, 2048)"
python3 -m moemesh.bench.kernels_fused --out-dir "$RESULTS_DIR" --tokens 1,8,64,2048 --ops gate_learned,gate_hash 2>&1 \
  | grep --line-buffered -v -i "warn"
stamp "bench.layers decode B=1,64 with the fused glue"
timeout 75 python3 -m moemesh.bench.layers --no-transformers --batch 1,64 --prefill= --out-dir "$RESULTS_DIR" 2>&1 \
  | grep --line-buffered -v -i "warn\|debug"
stamp "done"
