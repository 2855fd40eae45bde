#!/usr/bin/env bash
# CUDA graphs of the serving attention worker's decode steps (services/attention/graph_decode.py).
# 1. timing of decode steps eager vs graphs at B = 1/8/64 (Flash width, 2 window + 4 CSA/HCA layers, 4K context),
#    experts none / in-process, first step compared bit for bit; 2. CUDA tests: graph replays vs the eager
#    ModelRunner, tiny fp32 (join/leave, window closes, 2 micro-batches, paged rows) and V4-Flash width bf16.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
# GRAPHS_CAP_S: the cap run_all gives this script (default 120 s).
set -u
cap="${GRAPHS_CAP_S:-120}"
start=$(date +%s)
left() { echo $(( cap - ($(date +%s) - start) - 5 )); }
stamp() { echo "--- decode-graphs: $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv
stamp "timing (left $(left)s)"
timeout -k 5 "$(( $(left) > 110 ? 110 : $(left) ))" python3 -m moemesh.bench.attention_graphs --batch 1,8,64 \
  --layers 4 --context 4096 --steps 10 --experts none,local --out-dir "$RESULTS_DIR" 2>&1 | grep -v '^\s*$' | tail -n 30
stamp "CUDA tests (left $(left)s)"
t=tests/test_attention_graphs_cuda.py
if [ "$(left)" -gt 20 ]; then
  timeout -k 5 "$(left)" python3 -m pytest -q -p no:cacheprovider -rA \
    "$t::test_tiny_graph_replays_match_eager" "$t::test_flash_width_graph_replays_match_eager" 2>&1 | tail -n 60
fi
stamp "done"
