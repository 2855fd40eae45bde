#!/usr/bin/env bash
# Same GPU, every expert on it: `moemesh serve --devices cuda:0 --cuda-graphs on` with the routed experts in the
# attention worker's process (`--experts-in-attention all`) against an expert worker process on the same GPU
# reached through the device mailbox (`--experts-in-attention none --data-plane mailbox`, MPS), and optionally
# through CUDA IPC rings (`cuda_ipc`). Per configuration: one greedy completion (the texts must match), then
# `moemesh bench serve` at concurrency 1 and at SAME_GPU_BATCH (default 64), warm-up requests first; the server
# runs with MOEMESH_COUNT_HOST_SYNCS=1, so each result JSON carries the decode steps' ZeroMQ layer messages and
# host syncs per step and per layer. SAME_GPU_MODEL: `default` (the embedded model) or `flash` (a full-width
# V4-Flash checkpoint of SAME_GPU_LAYERS layers, default 8, written once by `moemesh bench make-checkpoint`).
# SAME_GPU_TESTS=1 runs the CUDA tests of the split step graph first (under the same MPS daemon).
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
MODEL_KIND="${SAME_GPU_MODEL:-default}"
CONFIGS="${SAME_GPU_CONFIGS:-all mailbox}"
BATCH="${SAME_GPU_BATCH:-64}"
PORT="${SAME_GPU_PORT:-8141}"
SECONDS=0
SECONDS_START_UTC=$(date -u +%Y%m%dT%H%M%SZ)  # result files of this run are named after it
source bench/device/mps.sh
if [ "${SAME_GPU_TESTS:-0}" = 1 ]; then
  echo "--- $(date -u +%T) CUDA tests (MPS)"
  timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider --timeout 200 tests/test_mailbox_step_graph_cuda.py 2>&1 \
    | tail -n 40
fi
model_args=()
label="default model"
if [ "$MODEL_KIND" = flash ]; then
  LAYERS="${SAME_GPU_LAYERS:-8}"
  CKPT="/tmp/moemesh-flash-${LAYERS}l"
  if [ ! -e "$CKPT/model.safetensors.index.json" ]; then
    echo "--- $(date -u +%T) writing $CKPT"
    python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers "$LAYERS" --out "$CKPT" 2>&1 | tail -n 2
  fi
  model_args=(--model "$CKPT")
  label="${LAYERS}-layer V4-Flash random checkpoint"
fi
for where in $CONFIGS; do
  RUN_DIR=/tmp/moemesh-same-gpu-$where
  rm -rf "$RUN_DIR"
  case "$where" in
    all) extra=(--experts-in-attention all) ;;
    mailbox) extra=(--experts-in-attention none --data-plane mailbox) ;;
    cuda_ipc) extra=(--experts-in-attention none --data-plane cuda_ipc) ;;
    *) echo "unknown configuration $where"; continue ;;
  esac
  MOEMESH_COUNT_HOST_SYNCS=1 python3 -m moemesh.cli serve "${model_args[@]}" --devices cuda:0 --port "$PORT" \
    --cuda-graphs on --speculation off "${extra[@]}" --run-dir "$RUN_DIR" > "$RUN_DIR.serve.log" 2>&1 &
  pid=$!
  mps_on_exit="kill -TERM $pid 2>/dev/null; wait $pid"
  wait_ready "$PORT" "$pid" 400
  echo "=== $(date -u +%T) $label, $where: ready=$ready after ${SECONDS}s"
  if [ "$ready" = 1 ]; then
    curl -s -m 300 "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "In the beginning God", "max_tokens": 24, "temperature": 0}' | grep -o '"text":"[^"]*"'
    for concurrency in 1 "$BATCH"; do
      python3 -m moemesh.cli bench serve --base-url "http://127.0.0.1:$PORT" --endpoint completions \
        --num-prompts $(( concurrency == 1 ? 12 : 2 * concurrency )) --warmup-requests "$concurrency" \
        --max-concurrency "$concurrency" --random-input-len 64 --random-output-len 96 --ignore-eos \
        --device-label "H200, $label, cuda graphs on, experts: $where, concurrency $concurrency" \
        --result-dir "$RESULTS_DIR" 2>&1 | grep -E "throughput|TPOT|server decode|wrote|completed|failed"
    done
    grep -h "mailbox\|data_plane" "$RUN_DIR"/logs/*.log 2>/dev/null | cut -c1-300 | head -n 8
  else
    tail -n 30 "$RUN_DIR.serve.log"
  fi
  kill -TERM $pid; wait $pid; echo "serve exited rc=$? (${SECONDS}s)"
  mps_on_exit=""
  grep -h "Error\|error\|Traceback" "$RUN_DIR"/logs/*.log 2>/dev/null | grep -v "error_rate\|errors=\[\]" | head -n 10
done
# the ratios of this run: each configuration's mean decode step (router) and median TPOT over experts in-process
python3 - "$RESULTS_DIR" "$SECONDS_START_UTC" "$label" <<'PY'
import json, sys, time
from pathlib import Path
results, started, label = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {}
for path in sorted(results.glob("serve-*.json")):
    data = json.loads(path.read_text())
    device = data.get("device", "")
    if not device.startswith(f"H200, {label},") or path.stem.split("-")[-1] < started:
        continue
    where = device.split("experts: ")[1].split(",")[0]
    concurrency = int(device.rsplit("concurrency ", 1)[1])
    steps = data["raw"].get("server_decode_steps") or {}
    runs[f"{where}@{concurrency}"] = {"file": path.name, "decode_step_ms": steps.get("decode_step_ms"),
                                      "median_tpot_ms": data["raw"]["metrics"]["tpot_ms"]["median"],
                                      "data_messages_per_layer": steps.get("data_messages_per_layer"),
                                      "host_syncs_per_step": steps.get("host_syncs_per_step")}
ratios = {}
for key, run in runs.items():
    where, concurrency = key.split("@")
    base = runs.get(f"all@{concurrency}")
    if where != "all" and base and run["decode_step_ms"] and base["decode_step_ms"]:
        ratios[f"{where}_over_all_decode_step@{concurrency}"] = run["decode_step_ms"] / base["decode_step_ms"]
        ratios[f"{where}_over_all_median_tpot@{concurrency}"] = run["median_tpot_ms"] / base["median_tpot_ms"]
out = results / f"same-gpu-split-h200-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
out.write_text(json.dumps({"benchmark": "same-gpu-split", "model": label, "runs": runs, "ratios": ratios}, indent=1))
print(json.dumps(ratios, indent=1))
PY
