#!/usr/bin/env bash
# The CUDA tests of the quantized path and its neighbours on the GPU (each skips on a machine without one):
# FP8/FP4 kernels against torch at V4-Flash shapes and the bf16 drift bound, the expert worker's GPU path,
# sampler and speculation kernels, CUDA IPC and ZeroMQ staging (outputs equal to in-process), prefix-cache
# boundary snapshots on the kernel path, a checkpoint's drafter on the GPU, the whole-step graph (all experts here, or
# split with CPU expert workers through mailboxes), the routed-expert row layout and the k-quartered gate-up/down handoff.
# CUDA_TESTS_EXTRA adds test files; CUDA_TESTS_FILES replaces the list.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH set; CUDA_TESTS_WORKERS (default 4) pytest-xdist
# workers share the GPU, one test file each, under NVIDIA MPS (tests start expert worker processes on the same GPU,
# and the device mailbox's spin-waits need the processes' kernels to run side by side).
set -u
source bench/device/mps.sh
DEFAULT_FILES="tests/test_quantized_cuda.py tests/test_kernels_cuda.py tests/test_hostwork_dispatch.py \
  tests/test_draft_random_checkpoint.py tests/test_spec_cuda.py tests/test_sampler_cuda.py \
  tests/test_wire_cuda_ipc.py tests/test_bench_fullsize.py::test_gpu_expert_worker_path_matches_cpu_path \
  tests/test_guided_masks.py tests/test_wire_staging.py tests/test_attention_boundary_kernels.py \
  tests/test_attention_prefix_restore.py tests/test_bench_layers_disagg.py tests/test_step_graph_cuda.py \
  tests/test_attention_graphs_cuda.py tests/test_local_experts.py tests/test_mailbox_step_graph_cuda.py \
  tests/test_route_layout_cuda.py tests/test_quartered_handoff.py tests/test_step_phases.py \
  tests/test_verify_sampled.py tests/test_verify_argmax_path.py"
# shellcheck disable=SC2086
python3 -m pytest -q -rfEs -n "${CUDA_TESTS_WORKERS:-4}" --tb=short -p no:cacheprovider --timeout 200 \
  ${CUDA_TESTS_FILES:-$DEFAULT_FILES} ${CUDA_TESTS_EXTRA:-} 2>&1
