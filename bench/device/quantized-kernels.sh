#!/usr/bin/env bash
# Quantized-weight kernels (`moemesh bench kernels`): the FP8 linear sweep, the FP4 grouped experts with
# their default configurations, then the CUDA tests of both. Run by bench/device/run_all.sh from the repo
# root; log to stdout, JSON into $RESULTS_DIR. Each stage has its own timeout (cap 240 s).
set -u
: "${RESULTS_DIR:?}"
nvidia-smi -L
echo "--- $(date +%T) fp8 linear sweep"
timeout 105 python3 -m moemesh.bench.kernels --out-dir "$RESULTS_DIR" --only fp8 --no-baselines --tokens 1 2048 64
echo "--- $(date +%T) fp4 experts, default configurations"
timeout 30 python3 -m moemesh.bench.kernels --out-dir "$RESULTS_DIR" --only fp4 --sweep none --no-baselines --tokens 1 64 2048
echo "--- $(date +%T) tests"
timeout 45 python3 -m pytest -v --tb=line -p no:cacheprovider tests/test_kernels_cuda.py tests/test_quantized_cuda.py \
  -k "fp8_T or fp8_asm or experts_fmt0 or test_quantized" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|Error|passed|failed|assert" | tail -n 40
echo "--- $(date +%T) done"
