#!/usr/bin/env bash
# Runs device steps in one call to the lent GPU machine (see bench/device/README.md).
# Usage (from the repo root, on the device): bash bench/device/run_all.sh NAME:SECONDS [NAME:SECONDS ...]
# Each NAME is bench/device/NAME.sh, run with a wall-clock cap; its stdout+stderr go to $OUT/logs/NAME.log,
# its result files to $RESULTS_DIR (= $OUT/results). Everything is packed into $OUT/device.tar.gz at the end
# (the device returns at most 8 files).
set -u
: "${OUT:?OUT must be set (the output folder of the device run)}"
export RESULTS_DIR="$OUT/results" LOG_DIR="$OUT/logs"
mkdir -p "$RESULTS_DIR" "$LOG_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD" || echo "wheel install failed"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$LOG_DIR/nvidia-smi.txt" 2>&1
for spec in "$@"; do
  name="${spec%%:*}"; secs="${spec##*:}"
  start=$(date +%s)
  echo "=== $name (cap ${secs}s) ==="
  timeout -k 10 "$secs" bash "bench/device/$name.sh" > "$LOG_DIR/$name.log" 2>&1
  rc=$?
  echo "=== $name rc=$rc wall=$(( $(date +%s) - start ))s"
  tail -n 25 "$LOG_DIR/$name.log"
done
tar czf "$OUT/device.tar.gz" -C "$OUT" logs results && rm -rf "$LOG_DIR" "$RESULTS_DIR"
ls -la "$OUT"
