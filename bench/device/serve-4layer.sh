#!/usr/bin/env bash
# `moemesh serve` on a full-width V4-Flash checkpoint with random weights: SERVE_LAYERS (default 4) main
# layers written once by `moemesh bench make-checkpoint --preset v4-flash` to SERVE_CHECKPOINT (about 16 GB
# at 4 layers; reused when present), checked by `moemesh check-model --no-forward`, then served
# with the attention worker and one expert worker on cuda:0 and a second expert worker on the CPU
# (`--devices cuda:0,cpu --expert-workers 2`), one chat request answered, then `moemesh bench serve`
# (SERVE_PROMPTS random prompts, 128 tokens in, 32 out) against it through HTTP; its JSON goes to
# $RESULTS_DIR and the services' load events to the log.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
LAYERS="${SERVE_LAYERS:-4}"
CKPT="${SERVE_CHECKPOINT:-/tmp/moemesh-serve-${LAYERS}l}"
PORT="${SERVE_PORT:-8123}"
RUN_DIR=/tmp/moemesh-serve-4layer-run
SECONDS=0
# services share cuda:0: NVIDIA MPS runs throughout
source bench/device/mps.sh
if [ ! -e "$CKPT/model.safetensors.index.json" ]; then
  echo "--- $(date -u +%H:%M:%S) writing $CKPT"
  python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers "$LAYERS" --out "$CKPT" 2>&1
  echo "make-checkpoint rc=$? after ${SECONDS}s"; df -h "$(dirname "$CKPT")" | tail -n 1
fi
echo "--- $(date -u +%H:%M:%S) check-model (${SECONDS}s)"
python3 -m moemesh.cli check-model --model "$CKPT" --no-forward 2>&1 | tail -n 8
rm -rf "$RUN_DIR"
echo "--- $(date -u +%H:%M:%S) serve (${SECONDS}s)"
python3 -m moemesh.cli serve --model "$CKPT" --expert-workers 2 --devices cuda:0,cpu --port "$PORT" \
  --run-dir "$RUN_DIR" --ready-timeout "${SERVE_READY_S:-600}" > "$RUN_DIR.serve.log" 2>&1 &
SERVE_PID=$!
mps_on_exit='kill -TERM $SERVE_PID 2>/dev/null; wait $SERVE_PID; echo "serve exited"' 
wait_ready "$PORT" "$SERVE_PID" "${SERVE_READY_S:-600}"
echo "ready=$ready after ${SECONDS}s"
grep -h '"event": "[a-z_.]*load[a-z_.]*"' "$RUN_DIR"/logs/*.log 2>/dev/null | cut -c1-400 | tail -n 12
if [ "$ready" != 1 ]; then tail -n 40 "$RUN_DIR.serve.log"; exit 1; fi
echo "--- $(date -u +%H:%M:%S) one chat request"
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0}' | cut -c1-600
echo
echo "--- $(date -u +%H:%M:%S) bench serve"
python3 -m moemesh.cli bench serve --base-url "http://127.0.0.1:$PORT" --endpoint chat \
  --num-prompts "${SERVE_PROMPTS:-32}" --max-concurrency 8 --random-input-len 128 --random-output-len 32 \
  --ignore-eos --device-label "H200 + CPU, ${LAYERS}-layer V4-Flash random checkpoint" --result-dir "$RESULTS_DIR" \
  2>&1 | tail -n 30
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^moemesh_worker_weight_bytes|^moemesh_.*load' | head -n 20
curl -s "http://127.0.0.1:$PORT/status.json" > "$RESULTS_DIR/serve-4layer-status.json"
cp "$RUN_DIR"/logs/*.log "$RESULTS_DIR/" 2>/dev/null
