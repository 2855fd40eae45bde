#!/usr/bin/env bash
# Speculative decoding on the H200 (issue 6): CUDA correctness tests first, then the speculation
# benchmark with every service on cuda:0 (speculation off / fixed / adaptive, temperature 0 and 1,
# 1 and 8 streams; the speedups come from the same run), then the CPU benchmark on this host's
# cores with the drafter of this tree.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH set; result JSON and the
# servers' service logs go to $RESULTS_DIR.
set -u
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
# Several moemesh processes share one GPU: MPS (architecture.md §10). Already running is fine.
nvidia-cuda-mps-control -d && echo "spec.sh: MPS started" || echo "spec.sh: MPS not started (already running?)"
trap 'echo quit | nvidia-cuda-mps-control; echo "spec.sh: MPS stopped"' EXIT

python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))"

echo "=== CUDA correctness (drafter on cuda equals cpu; sampled drafts valid)"
timeout 30 python3 -m pytest -x -q -p no:cacheprovider tests/test_spec_cuda.py 2>&1 | tail -n 15

echo "=== bench speculation on cuda:0, float32 (greedy outputs comparable across modes)"
timeout 90 python3 -m bench.speculation --devices cuda:0 --dtype float32 --max-tokens 64 --streams 8 \
  --request-timeout-s 25 --keep-logs "$RESULTS_DIR/spec-logs-cuda" --out-dir "$RESULTS_DIR"
echo "bench rc=$?"

CPU_ARGS="--devices cpu --modes off,fixed --max-tokens 32 --streams 8 --temperatures 0,1 --request-timeout-s 20"
echo "=== bench speculation on this host's CPU (4 threads per process), this tree"
OMP_NUM_THREADS=4 timeout 35 python3 -m bench.speculation $CPU_ARGS --keep-logs "$RESULTS_DIR/spec-logs-cpu" \
  --out-dir "$RESULTS_DIR"
echo "bench rc=$?"

