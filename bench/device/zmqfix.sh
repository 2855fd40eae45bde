#!/usr/bin/env bash
# ZeroMQ data plane checks: staging buffers must not be reused while queued (tracker of the last frame
# only) and inline tensors must not be read before their asynchronous device->host copy landed. First the
# ZeroMQ-vs-in-process equality tests (expert processes on GPU 0, so NVIDIA MPS runs throughout,
# docs/design.md §10), then, time allowing, the staging CUDA tests
# (including the control that shows the stale inline read with every copy asynchronous).
# Run from the repo root by bench/device/run_all.sh; cap 60 s.
set -u
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS did not start"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
SECONDS=0
PYTEST="python3 -X faulthandler -m pytest -v -p no:cacheprovider -rfs --durations=5"
FILTER='PASSED|FAILED|SKIPPED|ERROR|Error|passed|failed|Timeout|s call'
echo "--- zmqfix: $(date -u +%H:%M:%S) ZeroMQ = CUDA IPC = in-process, 1 and 2 micro-batches"
timeout -k 5 46 $PYTEST tests/test_wire_cuda_ipc.py -k "outputs_equal" > "$RESULTS_DIR/zmqfix-equal.log" 2>&1
echo "pytest rc=$?"; grep -E "$FILTER" "$RESULTS_DIR/zmqfix-equal.log" | tail -n 12
if [ "$SECONDS" -lt 46 ]; then
  echo "--- zmqfix: $(date -u +%H:%M:%S) staging CUDA tests (${SECONDS}s used)"
  timeout -k 3 $(( 57 - SECONDS )) $PYTEST tests/test_wire_staging.py -k "cuda or device or ring" 2>&1 \
    | grep -E "$FILTER" | tail -n 12
fi
echo "--- zmqfix: $(date -u +%H:%M:%S) done (${SECONDS}s)"
