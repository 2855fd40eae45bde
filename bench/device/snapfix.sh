#!/usr/bin/env bash
# Prefix-cache boundary snapshots on the Triton kernel path: the recording stores'
# `mark_written` copies each crossed block end's snapshot from the rings. First the CUDA variant of
# tests/test_attention_boundary_kernels.py (kernel-path prefill + decode with a recording state,
# restore at block ends 16/32/48/64, against a plain kernel-path state, bf16), then, time allowing,
# tests/test_attention_prefix_restore.py (the torch-path restore tests) on this machine.
# One process, no MPS. Run from the repo root by bench/device/run_all.sh; cap 60 s.
set -u
SECONDS=0
PYTEST="python3 -X faulthandler -m pytest -v -p no:cacheprovider -rfs --durations=5"
FILTER='PASSED|FAILED|SKIPPED|ERROR|Error|assert|passed|failed|Timeout|s call'
echo "--- snapfix: $(date -u +%H:%M:%S) CUDA kernel-path snapshots"
timeout -k 3 34 $PYTEST tests/test_attention_boundary_kernels.py -k "cuda or ring_writes" \
  > "$RESULTS_DIR/snapfix-cuda.log" 2>&1
echo "pytest rc=$?"; grep -E "$FILTER" "$RESULTS_DIR/snapfix-cuda.log" | tail -n 20
if [ "$SECONDS" -lt 52 ]; then
  echo "--- snapfix: $(date -u +%H:%M:%S) prefix restore tests (${SECONDS}s used)"
  timeout -k 2 $(( 57 - SECONDS )) $PYTEST tests/test_attention_prefix_restore.py -x 2>&1 \
    | grep -E "$FILTER" | tail -n 12
fi
echo "--- snapfix: $(date -u +%H:%M:%S) done (${SECONDS}s)"
