#!/usr/bin/env bash
# The GPU waiting side of the CPU expert mailbox: its CUDA tests, then the per-layer hop from a CUDA
# graph on cuda:0 to a native CPU worker process (echo: the round trip alone; experts: beside compute).
# Run by bench/device/run_all.sh from the repo root; log to stdout, JSON into $RESULTS_DIR.
set -u
: "${RESULTS_DIR:?}"
export MOEMESH_CACHE_DIR="${TMPDIR:-/tmp}/moemesh-cache"
echo "--- $(date +%T) tests"
timeout 240 python3 -m pytest -x -q -rfEs -p no:cacheprovider tests/test_mailbox_gpu.py 2>&1 | tail -n 30
echo "--- $(date +%T) bench: GPU graph <-> native CPU worker (worker pinned to the last core)"
last_cpu=$(( $(nproc) - 1 ))
timeout 240 python3 -m moemesh.bench.cpu_mailbox --waiting-side gpu --worker-cpu "$last_cpu" --T 1,8,64 \
  --modes echo,experts --waits spin,backoff --steps 20 --out-dir "$RESULTS_DIR" 2>&1 | grep -v "mailbox.worker"
