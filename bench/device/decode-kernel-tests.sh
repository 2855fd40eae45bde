#!/usr/bin/env bash
# The CUDA tests of the decode layer's kernels at V4-Flash sizes (cap ~150 s): fused glue (projections with their
# norm and RoPE, shared expert, top-k, RoPE tables), mHC sites, attention (output rotated back, splits merged in the
# launch), norm/RoPE, FP8 KV rows, routed-expert row layout and the k-quartered handoff. A subset of cuda-tests.sh
# for quick checks of kernel changes; CUDA_TESTS_EXTRA adds test files.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH set.
set -u
python3 -m pytest -q -rfEs -n "${CUDA_TESTS_WORKERS:-4}" --tb=short -p no:cacheprovider --timeout 200 \
  tests/test_decode_glue.py tests/test_kernels_mhc.py tests/test_kernels_attention_cuda.py \
  tests/test_kernels_norm_rope.py tests/test_kv_fp8_kernels.py tests/test_route_layout_cuda.py \
  tests/test_quartered_handoff.py tests/test_quantized_cuda.py ${CUDA_TESTS_EXTRA:-} 2>&1
