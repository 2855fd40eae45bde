#!/usr/bin/env bash
# Long context at full width through `moemesh serve`: a V4-Flash checkpoint with random weights of LC_LAYERS
# (default 8) main layers, written by `moemesh bench make-checkpoint --preset v4-flash` to LC_CHECKPOINT (about
# 4.6 GB per layer; reused when present), served on cuda:0 alone with the routed experts in the attention worker,
# KV rows as LC_KV_DTYPE (default fp8) and the device pool sized by `--kv-tokens auto`; then
# `moemesh bench long-context` (LC_LENGTHS, default 65536,131072 prompt tokens, LC_DECODE output tokens) against
# it (`--step-timeout` LC_STEP_TIMEOUT, default 180 s: the first steps compile and capture). LC_SERVE_ARGS and
# LC_BENCH_ARGS pass more options to each. Its JSON goes to $RESULTS_DIR, the attention worker's capacity and budget
# events and the router's warm-up events to the log.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
LAYERS="${LC_LAYERS:-8}"
KV_DTYPE="${LC_KV_DTYPE:-fp8}"
CKPT="${LC_CHECKPOINT:-/tmp/moemesh-lc-${LAYERS}l}"
PORT="${LC_PORT:-8124}"
RUN_DIR=/tmp/moemesh-long-context-run
SECONDS=0
source bench/device/mps.sh  # the attention worker and the (empty) expert worker share cuda:0
if [ ! -e "$CKPT/model.safetensors.index.json" ]; then
  echo "--- $(date -u +%H:%M:%S) writing $CKPT"
  python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers "$LAYERS" --out "$CKPT" 2>&1 | tail -n 2
  df -h "$(dirname "$CKPT")" | tail -n 1
fi
rm -rf "$RUN_DIR"
echo "--- $(date -u +%H:%M:%S) serve (${SECONDS}s)"
python3 -m moemesh.cli serve --model "$CKPT" --devices cuda:0 --kv-dtype "$KV_DTYPE" --kv-tokens "${LC_KV_TOKENS:-auto}" \
  --port "$PORT" --run-dir "$RUN_DIR" --ready-timeout 600 --step-timeout "${LC_STEP_TIMEOUT:-180}" ${LC_SERVE_ARGS:-} > "$RUN_DIR.serve.log" 2>&1 &
SERVE_PID=$!
mps_on_exit='kill -TERM $SERVE_PID 2>/dev/null; wait $SERVE_PID; echo "serve exited"'
wait_ready "$PORT" "$SERVE_PID" 600
echo "ready=$ready after ${SECONDS}s"
grep -h '"event": "\(attention.kv_capacity\|attention.memory_budget\|router.warm_up_wave\|router.warm_up_finished\|router.warm_up_failed\)"' \
  "$RUN_DIR"/logs/*.log 2>/dev/null | cut -c1-1500
if [ "$ready" != 1 ]; then tail -n 40 "$RUN_DIR.serve.log"; tail -n 40 "$RUN_DIR"/logs/*.log; exit 1; fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
echo "--- $(date -u +%H:%M:%S) bench long-context (${SECONDS}s)"
python3 -m moemesh.cli bench long-context --base-url "http://127.0.0.1:$PORT" --model-dir "$CKPT" \
  --lengths "${LC_LENGTHS:-65536,131072}" --decode-tokens "${LC_DECODE:-32}" --probes 5 --log-dir "$RUN_DIR/logs" \
  --ceilings-device cuda:0 --kv-dtype "$KV_DTYPE" \
  --label "H200, ${LAYERS}-layer V4-Flash random checkpoint, ${KV_DTYPE} KV, serve --kv-tokens ${LC_KV_TOKENS:-auto}" \
  --out-dir "$RESULTS_DIR" ${LC_BENCH_ARGS:-} 2>&1 | tail -n 30
echo "bench rc=$? after ${SECONDS}s"
grep -h '"event": "attention.step_phases\|"level": "error"\|"level": "warning"' "$RUN_DIR"/logs/*.log | cut -c1-600 | tail -n 20
