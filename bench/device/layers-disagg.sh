#!/usr/bin/env bash
# Disaggregated decode on one host (`moemesh bench layers-disagg`): the CUDA tests of the IPC data plane and the
# graphs, `bench layers --disaggregated` (in-process CUDA graphs vs an expert worker process over ZeroMQ and
# over CUDA IPC, eager and with graph segments), the killed-expert test on its own, the hop cost alone, and
# (two GPUs) the expert worker on cuda:1. Run from the repo root by bench/device/run_all.sh with PYTHONPATH
# and RESULTS_DIR set. Several CUDA processes share GPU 0, so NVIDIA MPS runs throughout (architecture.md §10).
set -u
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS did not start"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
NUM_GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "torch devices: $NUM_GPUS"
SECONDS=0
PYTEST="python3 -X faulthandler -m pytest -v -p no:cacheprovider -s"
FILTER='PASSED|FAILED|ERROR|Error|ring sync|Fatal|Segmentation|passed|failed|Timeout'
echo "--- layers-disagg: $(date -u +%H:%M:%S) CUDA tests: graphs equal eager, CUDA IPC equals ZeroMQ"
timeout -k 5 60 $PYTEST tests/test_bench_layers_disagg.py tests/test_wire_cuda_ipc.py -k "graphs or equal" \
  > "$RESULTS_DIR/disagg-pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "$FILTER" "$RESULTS_DIR/disagg-pytest.log" | grep -v "^PASSED" | tail -n 20
COMMON="--disaggregated --prefill= --no-transformers --steps 10 --micro-batches 2 --data-planes zmq,cuda_ipc"
echo "--- layers-disagg: $(date -u +%H:%M:%S) bench layers --disaggregated, one GPU (b1/8/64) (${SECONDS}s used)"
timeout -k 5 80 python3 -m moemesh.bench.layers $COMMON --batch 1,8,64 --graph-segments \
  --expert-graph-buckets 1,2,4,8,16,32,64 --out-dir "$RESULTS_DIR" 2>&1 | grep -v "^\s*$" | grep -v "debug" | tail -n 50
echo "--- layers-disagg: $(date -u +%H:%M:%S) killed expert (${SECONDS}s used)"
timeout -k 5 40 $PYTEST tests/test_wire_cuda_ipc.py -k killed > "$RESULTS_DIR/disagg-pytest-killed.log" 2>&1
echo "pytest rc=$?"; grep -E "$FILTER" "$RESULTS_DIR/disagg-pytest-killed.log" | grep -v "^PASSED" | tail -n 12
if [ "$SECONDS" -lt 190 ]; then
  echo "--- layers-disagg: $(date -u +%H:%M:%S) hop cost: ZeroMQ staging vs CUDA IPC rings (${SECONDS}s used)"
  timeout -k 5 25 python3 -m moemesh.bench.dispatch --device cuda:0 --tokens 1,64 --transports cuda_ipc,ipc \
    --iteration-scale 0.1 --out-dir "$RESULTS_DIR" 2>&1 | grep -v "^\s*$" | tail -n 6
fi
if [ "$NUM_GPUS" -ge 2 ] && [ "$SECONDS" -lt 200 ]; then
  echo "--- layers-disagg: $(date -u +%H:%M:%S) expert worker on cuda:1, attention on cuda:0 (${SECONDS}s used)"
  timeout -k 5 "$(( 228 - SECONDS ))" python3 -m moemesh.bench.layers $COMMON --batch 1,64 --graph-segments --no-in-process \
    --expert-device cuda:1 --expert-graph-buckets 1,2,4,8,16,32,64 --out-dir "$RESULTS_DIR" 2>&1 \
    | grep -v "^\s*$" | grep -E "disaggregated .*graphs=True|failed|Error" | tail -n 12
fi
echo "--- layers-disagg: $(date -u +%H:%M:%S) done (${SECONDS}s)"
