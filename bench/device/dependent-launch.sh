#!/usr/bin/env bash
# Programmatic dependent launches (common/kernels/dependent_launch.py) on one GPU (cap ~300 s; ~560 with the
# FP4 sweep): the CUDA tests with them on (the decode step's bits unchanged against plain launches, the mHC
# kernels' own cases), then `moemesh bench layers` at B = 1 and 64 for each MOEMESH_DEPENDENT_LAUNCH value in
# DEPENDENT_LAUNCH_MODES (default "0 wait-only"; the JSON records it under "environment"; kernels profiled at 0),
# then, with DEPENDENT_LAUNCH_FP4_SWEEP=1, the FP4 grouped-expert split-K variants at one token.
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
set -u
start=$(date +%s)
stamp() { echo "--- dependent-launch: $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
quiet() { grep --line-buffered -v -i "warn\|debug\|USDT"; }

stamp "CUDA tests"
timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_dependent_launch.py \
  tests/test_dependent_launch_cuda.py tests/test_route_counts.py tests/test_kernels_mhc.py tests/test_hc_post_slots.py \
  -k "cuda or hopper or gpu or compiled" -rs 2>&1 | tail -n 12
for mode in ${DEPENDENT_LAUNCH_MODES:-0 wait-only}; do
  profile="--no-kernel-profile"; [ "$mode" = 0 ] && profile=""
  stamp "bench.layers B=1,64, MOEMESH_DEPENDENT_LAUNCH=$mode"
  MOEMESH_DEPENDENT_LAUNCH=$mode timeout 125 python3 -m moemesh.bench.layers --no-transformers --batch 1,64 --prefill "" \
    --steps 10 $profile --out-dir "$RESULTS_DIR" 2>&1 | quiet | tail -n 30
done
[ "${DEPENDENT_LAUNCH_FP4_SWEEP:-0}" = 1 ] || { stamp "done"; exit 0; }
stamp "FP4 grouped experts at one token: ASM_QUAD split-K variants"
timeout 100 python3 -m moemesh.bench.kernels --out-dir "$RESULTS_DIR" --only fp4 --sweep small --no-baselines --tokens 1 \
  --fp4-decode asm_quad 2>&1 | grep -E "fp4 T|rror" | tail -n 40
stamp "done"
