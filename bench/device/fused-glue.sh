#!/usr/bin/env bash
# Fused glue kernels (`moemesh bench kernels-fused`): CUDA correctness first, then the 2-layer decode step end to end
# with the fused glue and with the torch glue (MOEMESH_TORCH_GLUE=1), then the mHC launch-config sweep.
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set; cap 240 s.
# Output is streamed (no tail), so a run cut by the cap still leaves what it printed.
set -u
start=$(date +%s)
stamp() { echo "--- fused-glue: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
stamp "glue checks at Flash sizes (one JSON line per case)"
python3 -m moemesh.bench.checks.glue_kernels --suite cuda 2>&1 | sed "s/\"stochastic_bound\": null, //; s/\"fp32_error\": null, //"
stamp "bench.layers decode B=1,64 with the fused glue"
timeout 75 python3 -m moemesh.bench.layers --no-transformers --batch 1,64 --prefill= --out-dir "$RESULTS_DIR" 2>&1 \
  | grep --line-buffered -v -i "warn\|debug"
stamp "bench.layers decode B=1,64 with the torch glue (MOEMESH_TORCH_GLUE=1)"
MOEMESH_TORCH_GLUE=1 timeout 75 python3 -m moemesh.bench.layers --no-transformers --batch 1,64 --prefill= \
  --out-dir "$RESULTS_DIR" 2>&1 | grep --line-buffered -v -i "warn\|debug"
stamp "mHC ops and the hc_pre launch-config sweep (T = 1, 64, 2048)"
python3 -m moemesh.bench.kernels_fused --out-dir "$RESULTS_DIR" --tokens 1,64,2048 --ops hc_pre,hc_head --sweep 2>&1 \
  | grep --line-buffered -v -i "warn"
stamp "done"
