#!/usr/bin/env bash
# Speculative decoding on the H200 (`moemesh bench speculation`), within a 330 s cap:
#   1. CUDA correctness tests (drafter on cuda equals cpu, graph replays equal eager; sampled drafts valid) (cap 70)
#   2. the speculation benchmark with every service on cuda:0, bf16 as served: off / fixed / adaptive (the
#      router's cost-aware widths) with the drafter in the attention worker, and fixed with it in a draft
#      worker process (fixed-process), temperature 0 and 1, a single stream, --repeats 2 (the second
#      repeat rotates the servers' order: the first-measured server looked slower under MPS)  ~150 s (cap 215)
#   3. the same benchmark on this host's CPU (4 threads per process)                      (cap 65)
# Each benchmark stops starting runs at its --time-budget-s and writes its JSON (bench.results_io)
# with the runs finished so far even when a run fails, a server does not start, or timeout's SIGTERM
# arrives; the servers' service logs go beside it. Run by bench/device/run_all.sh from the repo root
# with PYTHONPATH set; results go to $RESULTS_DIR.
# SPEC_MODEL: the checkpoint to serve (default: the shipped default model; e.g. /tmp/train-default-model-last,
# the one train-default-model.sh left on this warm machine). SPEC_SKIP_CPU=1 leaves out step 3. SPEC_MODES and
# SPEC_REPEATS replace step 2's modes and repeats (median of an odd count: the middle run); SPEC_MAX_TOKENS (64) and
# SPEC_TEMPERATURES (0,1) its output length and temperatures (one temperature per run keeps the attention workers'
# phase summaries apart). SPEC_BUDGET_S (170) is its --time-budget-s. SPEC_SKIP_TESTS=1 leaves
# out step 1. SPEC_TORCH_PROFILE=SKIP:COUNT profiles those steps of every server's attention worker (torch.profiler,
# MOEMESH_TORCH_PROFILE_STEPS; traces and tables under $RESULTS_DIR/torch-profile; the figures then carry its cost).
set -u
model_args=()
[ -n "${SPEC_MODEL:-}" ] && model_args=(--model "$SPEC_MODEL")
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
# Several moemesh processes share one GPU: MPS (architecture.md §10). Already running is fine.
nvidia-cuda-mps-control -d && echo "speculation.sh: MPS started" || echo "speculation.sh: MPS not started (already running?)"
trap 'echo quit | nvidia-cuda-mps-control; echo "speculation.sh: MPS stopped"' EXIT
start_s=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start_s ))s"; }

python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))"

if [ "${SPEC_SKIP_TESTS:-0}" != 1 ]; then
  echo "=== CUDA correctness (drafter on cuda equals cpu; sampled drafts valid) [$(elapsed)]"
  timeout -k 5 70 python3 -m pytest -q -p no:cacheprovider tests/test_spec_cuda.py tests/test_step_phases.py tests/test_verify_sampled.py \
    tests/test_verify_argmax_path.py 2>&1 | tail -n 15
fi
if [ -n "${SPEC_TORCH_PROFILE:-}" ]; then
  export MOEMESH_TORCH_PROFILE_STEPS="$SPEC_TORCH_PROFILE" MOEMESH_TORCH_PROFILE_DIR="$RESULTS_DIR/torch-profile"
fi

echo "=== bench speculation on cuda:0, bf16, ${SPEC_REPEATS:-2} repeats (the benchmark checks greedy outputs equal across modes) [$(elapsed)]"
budget_s=${SPEC_BUDGET_S:-170}
timeout -s TERM -k 15 $((budget_s + 45)) python3 -m moemesh.bench.speculation "${model_args[@]}" --devices cuda:0 \
  --max-tokens "${SPEC_MAX_TOKENS:-64}" --streams 1 --modes "${SPEC_MODES:-off,fixed,adaptive,fixed-process}" \
  --temperatures "${SPEC_TEMPERATURES:-0,1}" --repeats "${SPEC_REPEATS:-2}" --request-timeout-s 90 --time-budget-s "$budget_s" \
  --keep-logs "$RESULTS_DIR/spec-logs-cuda" --out-dir "$RESULTS_DIR"
echo "bench rc=$? [$(elapsed)]"

[ "${SPEC_SKIP_CPU:-0}" = 1 ] && exit 0
echo "=== bench speculation on this host's CPU (4 threads per process), this tree [$(elapsed)]"
OMP_NUM_THREADS=4 timeout -s TERM -k 10 65 python3 -m moemesh.bench.speculation "${model_args[@]}" --devices cpu --modes off,fixed,adaptive \
  --max-tokens 32 --streams 8 --temperatures 0,1 --request-timeout-s 20 --time-budget-s 40 \
  --keep-logs "$RESULTS_DIR/spec-logs-cpu" --out-dir "$RESULTS_DIR"
echo "bench rc=$? [$(elapsed)]"
