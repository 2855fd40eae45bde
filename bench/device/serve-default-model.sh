#!/usr/bin/env bash
# The embedded default model through `moemesh serve` with its defaults on a GPU machine (`--devices auto`:
# every service on cuda:0, under MPS): one chat request, a `response_format` json_schema request and a
# `logit_bias` request (the constrained-decoding masks applied on the GPU), then `moemesh bench serve`
# single stream (16 prompts, 64 tokens out) with CUDA graphs off and on. JSON to $RESULTS_DIR.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
# services share cuda:0: NVIDIA MPS runs throughout
source bench/device/mps.sh
PORT=8124
python3 -m moemesh.cli devices 2>&1 | tail -n 4
for graphs in off on; do
  RUN_DIR=/tmp/moemesh-default-$graphs
  rm -rf "$RUN_DIR"
  SECONDS=0
  python3 -m moemesh.cli serve --port "$PORT" --cuda-graphs "$graphs" --run-dir "$RUN_DIR" --speculation off \
    > "$RUN_DIR.serve.log" 2>&1 &
  pid=$!
  wait_ready "$PORT" "$pid" 240
  echo "=== cuda graphs $graphs: ready=$ready after ${SECONDS}s"
  if [ "$ready" = 1 ]; then
    grep -h '"event": "attention.loaded"' "$RUN_DIR"/logs/*.log | cut -c1-300
    curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
      -d '{"messages": [{"role": "user", "content": "Recite Psalms 23:1."}], "max_tokens": 40, "temperature": 0}' | cut -c1-500; echo
    curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
      -d '{"messages": [{"role": "user", "content": "Give a verse as JSON."}], "max_tokens": 60, "temperature": 0,
           "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object",
           "properties": {"book": {"type": "string", "maxLength": 12}, "chapter": {"type": "integer"}},
           "required": ["book", "chapter"], "additionalProperties": false}}}}' | cut -c1-500; echo
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "In the beginning", "max_tokens": 12, "temperature": 0, "logit_bias": {"5": -100}}' | cut -c1-400; echo
    python3 -m moemesh.cli bench serve --base-url "http://127.0.0.1:$PORT" --endpoint completions --num-prompts 16 \
      --max-concurrency 1 --random-input-len 64 --random-output-len 64 --ignore-eos \
      --device-label "H200, default model, cuda graphs $graphs" --result-dir "$RESULTS_DIR" 2>&1 \
      | grep -E "throughput|TPOT|wrote|completed"
  else
    tail -n 30 "$RUN_DIR.serve.log"
  fi
  kill -TERM $pid; wait $pid; echo "serve exited rc=$?"
done
