#!/usr/bin/env bash
# Every benchmark that needs a GPU, run through `moemesh bench NAME` at a small size: does each still run
# end to end and write its JSON? Not a measurement of speed (the sizes are cut to fit one device call);
# the full runs are the other scripts of this folder.
# EVERY_BENCHMARK_ONLY="name ..." runs a subset (the device call is capped at 10 minutes, so the list is
# usually split over two calls). The summary, one row per benchmark with its arguments, exit code, wall
# time and the result files it wrote, goes to $RESULTS_DIR/every-benchmark-<device>-<UTC>.json.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH and RESULTS_DIR set.
set -u
: "${RESULTS_DIR:?}"
source bench/device/mps.sh  # fullsize, layers-disagg and speculation start several processes on cuda:0
CKPT_DIR=/tmp/moemesh-every-benchmark
export MOEMESH_CHECKPOINT_CACHE="${MOEMESH_CHECKPOINT_CACHE:-/tmp/moemesh-checkpoints}"
SUMMARY=/tmp/every-benchmark-rows.jsonl
: > "$SUMMARY"

# name | cap seconds | arguments after `moemesh bench NAME` (the result directory is added where the
# benchmark takes one)
read -r -d '' TABLE <<EOF
kernels|70|--quick --no-baselines --tokens 1 64 --out-dir $RESULTS_DIR
kernels-attention|90|--quick --batch 1,8 --prefill 2048 --out-dir $RESULTS_DIR
kernels-prefill|60|--tokens 2048 --reps 3 --out-dir $RESULTS_DIR
kernels-fused|60|--tokens 1,64 --out-dir $RESULTS_DIR
kernels-drift|60|--seeds 3 --routing learned --skip-ops --out-dir $RESULTS_DIR
layers|90|--no-transformers --batch 1,8 --prefill 2048 --steps 3 --prefill-reps 1 --out-dir $RESULTS_DIR
layers-disagg|90|--no-transformers --batch 1 --prefill 2048 --steps 3 --prefill-reps 1 --out-dir $RESULTS_DIR
layers-profile|60|--steps 2
attention-graphs|90|--batch 1,8 --layers 2 --steps 3 --out-dir $RESULTS_DIR
dispatch|60|--device cuda:0 --tokens 1,8 --iteration-scale 0.1 --out-dir $RESULTS_DIR
hostwork|60|--device cuda:0 --tokens 1,8 --iterations 20 --out-dir $RESULTS_DIR
cpu-mailbox|60|--waiting-side gpu --modes echo --steps 5 --out-dir $RESULTS_DIR
fullsize-cpu|60|--threads 16 --tokens 1,8 --paths native --reps 2 --copy-bytes 268435456 --out-dir $RESULTS_DIR
fullsize|200|--experts-on cpu --layers 2 --checkpoint $CKPT_DIR --gpu-expert-budget 3GiB --batch 1,8 --routing uniform,skewed --decode-steps 3 --warmup-steps 1 --cuda-graphs --cpu-threads 16 --run-dir /tmp/every-fullsize --out-dir $RESULTS_DIR
fullsize-draft|150|--device cuda:0 --batches 1,8 --temperatures 0,1 --repeats 2 --warmup 1 --out-dir $RESULTS_DIR
speculation|130|--devices cuda:0 --dtype float32 --max-tokens 16 --streams 2 --modes off,fixed,adaptive --temperatures 0 --request-timeout-s 25 --time-budget-s 90 --out-dir $RESULTS_DIR
EOF

wanted() { [ -z "${EVERY_BENCHMARK_ONLY:-}" ] || [[ " $EVERY_BENCHMARK_ONLY " == *" $1 "* ]]; }

while IFS='|' read -r name cap args; do
  wanted "$name" || continue
  if [ "$name" = fullsize ] && [ ! -e "$CKPT_DIR/model.safetensors.index.json" ]; then
    echo "--- $(date -u +%H:%M:%S) make-checkpoint (2 V4-Flash layers) for fullsize"
    python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers 2 --out "$CKPT_DIR" 2>&1 | tail -n 2
  fi
  echo "--- $(date -u +%H:%M:%S) $name (cap ${cap}s): moemesh bench $name $args"
  before=$(ls "$RESULTS_DIR" | sort)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  timeout -k 10 "$cap" python3 -m moemesh.cli bench "$name" $args > "/tmp/every-$name.log" 2>&1
  rc=$?
  wall=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  tail -n 12 "/tmp/every-$name.log" | cut -c1-300
  cp "/tmp/every-$name.log" "$RESULTS_DIR/every-benchmark-$name.log"
  new=$(comm -13 <(echo "$before") <(ls "$RESULTS_DIR" | sort) | grep -v "^every-benchmark-" | tr '\n' ' ')
  echo "rc=$rc wall=${wall}s new files: $new"
  python3 - "$name" "$cap" "$rc" "$wall" "$args" "$new" >> "$SUMMARY" <<'PY'
import json, sys
name, cap, rc, wall, args, new = sys.argv[1:]
print(json.dumps({"benchmark": name, "cap_s": int(cap), "rc": int(rc), "wall_s": float(wall),
                  "args": args, "result_files": new.split()}))
PY
done <<< "$TABLE"

python3 - "$SUMMARY" "$RESULTS_DIR" <<'PY'
import json, sys
from pathlib import Path
from moemesh.bench.results_io import write_result
rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
path = write_result("every-benchmark", {"runs": rows, "failed": [r["benchmark"] for r in rows if r["rc"] != 0]},
                    out_dir=Path(sys.argv[2]))
print("summary:", path)
for r in rows:
    print(f"  {r['benchmark']:<18} rc={r['rc']:<4} {r['wall_s']:>6.1f}s  {' '.join(r['result_files'])}")
PY
