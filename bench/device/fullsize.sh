#!/usr/bin/env bash
# Full-size V4-Flash through moemesh's processes with random weights (issue 8 item 5, issue 10):
# attention worker + near expert worker on cuda:0 (MPS), far expert worker on the CPU, then on cuda:1.
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
# FULLSIZE_LAYERS (default 43) and FULLSIZE_BUDGET_GIB (default 100 GiB x layers / 43) scale the run;
# FULLSIZE_CPU_S / FULLSIZE_GPU1_S cap each configuration (each writes fullsize-partial.json as it goes).
set -u
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS did not start"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
LAYERS="${FULLSIZE_LAYERS:-43}"
BUDGET="${FULLSIZE_BUDGET_GIB:-$(( 100 * LAYERS / 43 ))}"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
NCPU=$(nproc)
echo "torch devices: $NGPU; cpus: $NCPU; mem: $(free -g | awk '/Mem:/ {print $2}') GiB; layers $LAYERS budget ${BUDGET}GiB"
SECONDS=0
echo "--- fullsize: $(date -u +%H:%M:%S) CUDA test"
timeout -k 5 20 python3 -m pytest -x -q -p no:cacheprovider tests/test_bench_fullsize.py -k gpu 2>&1 | tail -n 15
echo "--- fullsize: $(date -u +%H:%M:%S) CPU expert path throughput (${SECONDS}s used)"
timeout -k 5 "${FULLSIZE_CPUBENCH_S:-25}" python3 -m bench.fullsize_cpu --threads "1,16,$(( NCPU - 4 ))" --reps 2 \
  --out-dir "$RESULTS_DIR" 2>&1 | tail -n 12
run_config() {  # NAME FAR_DEVICE CAP_S EXTRA...
  local name="$1" far="$2" cap="$3"; shift 3
  echo "--- fullsize: $(date -u +%H:%M:%S) $name (${SECONDS}s used, cap ${cap}s)"
  rm -rf "/tmp/fs-$name"; mkdir -p "/tmp/fs-$name-out"
  timeout -k 5 "$cap" python3 -m bench.fullsize --experts-on "$far" --layers "$LAYERS" \
    --gpu-expert-budget "${BUDGET}GiB" --routing uniform,skewed --decode-steps 3 --warmup-steps 1 \
    --run-dir "/tmp/fs-$name" --out-dir "/tmp/fs-$name-out" "$@" 2>&1 | cut -c1-400 | tail -n 60
  for f in "/tmp/fs-$name-out"/*.json; do [ -e "$f" ] && cp "$f" "$RESULTS_DIR/$name-$(basename "$f")"; done
  for f in "/tmp/fs-$name"/*.stderr; do echo "== $f"; grep -v '"level": "info"' "$f" | tail -n 4 | cut -c1-500; done
}
run_config cpu cpu "${FULLSIZE_CPU_S:-120}" --batch 1,8 --context 16
if [ "$NGPU" -ge 2 ]; then
  CMP=$(ls /tmp/fs-cpu-out/fullsize-2*.json /tmp/fs-cpu-out/fullsize-partial.json 2>/dev/null | head -n 1)
  run_config gpu1 cuda:1 "${FULLSIZE_GPU1_S:-110}" --batch 1,8,64 --context 16 --prefill 2048,8192 \
    ${CMP:+--compare "$CMP"}
fi
echo "--- fullsize: $(date -u +%H:%M:%S) done (${SECONDS}s)"
