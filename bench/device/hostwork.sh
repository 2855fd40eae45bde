#!/usr/bin/env bash
# Per-Dispatch host work (`moemesh bench hostwork`): the CUDA correctness tests of the expert-worker /
# dispatch paths, then the timings on cuda:0 (the services' code against the device-side split), then the CUDA IPC equality tests
# with whatever is left of the cap (120 s). Run from the repo root by bench/device/run_all.sh.
set -u
cap_s=${HOSTWORK_CAP_S:-115}
left() { echo $(( cap_s - SECONDS )); }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
echo "--- CUDA tests: hostwork, the quantized worker's kernel path, dispatch staging ($(date -u +%T))"
timeout 50 python3 -m pytest -x -q -p no:cacheprovider tests/test_dispatch_staging.py tests/test_hostwork_selection.py \
  "tests/test_bench_fullsize.py::test_gpu_expert_worker_path_matches_cpu_path" tests/test_hostwork_dispatch.py
echo "tests rc=$? at ${SECONDS}s"
echo "--- bench.hostwork ($(date -u +%T))"
budget=$(( $(left) - 25 )); [ "$budget" -lt 20 ] && budget=20
timeout "$budget" python3 -m moemesh.bench.hostwork --device cuda:0 --out-dir "$RESULTS_DIR" --iterations 100
echo "bench rc=$? at ${SECONDS}s"
if [ "$(left)" -gt 15 ]; then
  echo "--- CUDA IPC equality tests ($(date -u +%T), $(left) s left)"
  timeout "$(( $(left) - 3 ))" python3 -m pytest -x -q -p no:cacheprovider tests/test_wire_cuda_ipc.py \
    -k "equal or flag_ordered"
  echo "ipc tests rc=$? at ${SECONDS}s"
fi
if [ "$(left)" -gt 20 ]; then
  echo "--- bench.hostwork at the true expert width 2048 ($(date -u +%T), $(left) s left)"
  timeout "$(( $(left) - 3 ))" python3 -m moemesh.bench.hostwork --device cuda:0 --out-dir "$RESULTS_DIR" --iterations 50 \
    --tokens 1,8 --intermediate 2048
  echo "bench (width 2048) rc=$? at ${SECONDS}s"
fi
