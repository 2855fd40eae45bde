#!/usr/bin/env bash
# Where a served decode step's time goes: the default model through `moemesh serve --devices cuda:0` (every
# expert in the attention worker, CUDA graphs by default), single stream. Run PROFILE_RUNS (default "plain
# profiled"): "plain" measures `moemesh bench serve` (16 prompts, 64 in / 128 out, after 4 warm-up requests
# of the same shape) and the router's own step time (/status.json: step_seconds_total / num_steps, plan sent
# .. result back, warm-up included);
# "profiled" repeats it with MOEMESH_PROFILE_DIR set (every service under cProfile), stops serve and prints
# the router's and the attention worker's functions by own and cumulative time.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
source bench/device/serve-wait.sh
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
PORT=8127
EXTRA="${PROFILE_SERVE_ARGS:-}"
status_field() { curl -s "http://127.0.0.1:$PORT/status.json" | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(e['num_steps'], e['step_seconds_total'])"; }
for run in ${PROFILE_RUNS:-plain profiled}; do
  RUN_DIR=/tmp/moemesh-profile-$run
  rm -rf "$RUN_DIR"; mkdir -p "$RUN_DIR"
  if [ "$run" = profiled ]; then export MOEMESH_PROFILE_DIR="$RUN_DIR/prof"; else unset MOEMESH_PROFILE_DIR; fi
  # shellcheck disable=SC2086
  python3 -m moemesh.cli serve --devices cuda:0 --port "$PORT" --speculation off --run-dir "$RUN_DIR" $EXTRA \
    > "$RUN_DIR.serve.log" 2>&1 &
  pid=$!
  wait_ready "$PORT" "$pid" 180
  echo "=== $run: ready=$ready"
  if [ "$ready" != 1 ]; then tail -n 30 "$RUN_DIR.serve.log"; kill -TERM $pid; wait $pid; continue; fi
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "In the beginning God", "max_tokens": 32, "temperature": 0}' | grep -o '"text":"[^"]*"'
  read -r steps0 secs0 < <(status_field)
  # 4 warm-up requests of the same shape first (prefill compiles, graph captures), left out of the figures
  python3 -m moemesh.cli bench serve --base-url "http://127.0.0.1:$PORT" --endpoint completions --num-prompts 16 \
    --warmup-requests 4 --max-concurrency 1 --random-input-len 64 --random-output-len 128 --ignore-eos \
    --device-label "H200, default model, --devices cuda:0 $EXTRA ($run)" --result-dir "$RESULTS_DIR" 2>&1 \
    | grep -E "throughput|TPOT|ITL|wrote|completed"
  read -r steps1 secs1 < <(status_field)
  python3 -c "n=$steps1-$steps0; s=$secs1-$secs0; print(f'router: {n} steps, {1e3*s/max(n,1):.3f} ms a step (plan sent .. result back)')"
  grep -hE '"event": "attention\.(graphs|step_graph)' "$RUN_DIR"/logs/attention*.log | cut -c1-250 | head -n 6
  kill -TERM $pid; wait $pid; echo "serve exited rc=$?"
  if [ "$run" = profiled ]; then
    for f in "$RUN_DIR"/prof/*.prof; do
      echo "##### $(basename "$f")"
      python3 - "$f" <<'PY'
import pstats, sys
stats = pstats.Stats(sys.argv[1])
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(45)
PY
    done 2>&1 | sed -e 's#/[^ ]*/site-packages/##' -e "s#$PWD/##" | cut -c1-220
    cp "$RUN_DIR"/prof/*.prof "$RESULTS_DIR/" 2>/dev/null
  fi
done
