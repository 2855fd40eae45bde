#!/usr/bin/env bash
# Routed experts in the attention worker's own process (`--experts-in-attention`): the CUDA tests (the local
# share equals an expert worker's reply, segment graphs over CUDA IPC), then the default model through
# `moemesh serve --devices cuda:0 --cuda-graphs on` with every expert in the attention worker (the default on
# one device) and with the experts in an expert worker process (`none`, CUDA IPC, MPS): one greedy completion
# each (the texts must match) and `moemesh bench serve`, single stream, 16 prompts, 64 in / 64 out.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
source bench/device/mps.sh
echo "--- $(date +%T) CUDA tests"
timeout 100 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_local_experts.py \
  "tests/test_bench_layers_disagg.py::test_segment_graphs_over_cuda_ipc_equal_the_eager_in_process_step" 2>&1 | tail -n 15
PORT=8131
for where in all none; do
  RUN_DIR=/tmp/moemesh-local-$where
  rm -rf "$RUN_DIR"
  extra=()
  [ "$where" = none ] && extra=(--data-plane cuda_ipc)
  python3 -m moemesh.cli serve --devices cuda:0 --port "$PORT" --cuda-graphs on --speculation off \
    --experts-in-attention "$where" "${extra[@]}" --run-dir "$RUN_DIR" > "$RUN_DIR.serve.log" 2>&1 &
  pid=$!
  wait_ready "$PORT" "$pid" 120
  echo "=== experts in attention: $where, ready=$ready"
  if [ "$ready" = 1 ]; then
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "In the beginning God", "max_tokens": 32, "temperature": 0}' | grep -o '"text":"[^"]*"'
    python3 -m moemesh.cli bench serve --base-url "http://127.0.0.1:$PORT" --endpoint completions --num-prompts 16 \
      --max-concurrency 1 --random-input-len 64 --random-output-len 64 --ignore-eos \
      --device-label "H200, default model, cuda graphs on, experts in attention: $where" --result-dir "$RESULTS_DIR" 2>&1 \
      | grep -E "throughput|TPOT|wrote|completed"
  else
    tail -n 30 "$RUN_DIR.serve.log"
  fi
  kill -TERM $pid; wait $pid; echo "serve exited rc=$?"
done
