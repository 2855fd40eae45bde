#!/usr/bin/env bash
# Full-size V4-Flash through moemesh's processes with random weights (`moemesh bench fullsize`): the
# attention worker + near expert worker on cuda:0 (MPS), the far expert worker on the CPU ("cpu") or on
# cuda:1 over ZeroMQ ("gpu1") or over the CUDA IPC data plane ("gpu1ipc": the cuda:1 worker maps cuda:0's
# rings and reads / writes them over NVLink).
# Run from the repo root by bench/device/run_all.sh with PYTHONPATH and RESULTS_DIR set.
# Weights: a hub-format checkpoint with random weights and the DSpark stages (`moemesh bench
# make-checkpoint --preset v4-flash --layers N --dspark`), written once to FULLSIZE_CHECKPOINT (default
# /tmp/moemesh-fullsize-N) before the timed configurations and loaded from disk by every worker; it needs
# its stored size on disk (about 3.6 GB per layer + 13 GB: 43 layers need the 235 GB disk of the 4- and
# 8-GPU machines).
# Knobs (environment): FULLSIZE_LAYERS (default 43), FULLSIZE_BUDGET_GIB (default 100 GiB x layers / 43),
# FULLSIZE_CONTEXT (tokens per sequence, default 256; FULLSIZE_MAX_CONTEXT caps B x context, default 8192),
# FULLSIZE_CONFIGS (default "gpu1spec gpu1ipcspec"; the first configuration also pays the Triton compiles,
# which later ones find in the cache), FULLSIZE_TEST=1 runs the CUDA test first, FULLSIZE_<CONFIG>_S the cap
# of each configuration (each writes fullsize-partial.json as it goes, copied as fullsize-<config>-partial.json).
# Configurations:
#   cpu / cpugraphs: far experts on the CPU (FULLSIZE_CPU_THREADS), batch FULLSIZE_CPU_BATCH (1,8), eager / CUDA graphs;
#   gpu1 / gpu1ipc / gpu1graphs / gpu1ipcgraphs: far experts on cuda:1 over ZeroMQ / CUDA IPC, batch
#     FULLSIZE_GPU1_BATCH (1,8,64), prefill FULLSIZE_PREFILL (2048,8192; not with graphs);
#   gpu1prefill / gpu1ipcprefill: the 8K prefill alone over ZeroMQ / CUDA IPC;
#   gpu1spec / gpu1ipcspec: cuda:1 experts over ZeroMQ / CUDA IPC, uniform routing, batch
#     FULLSIZE_SPEC_BATCH (1,8), each plain decode run repeated with speculation: oracle drafts (the
#     plain run's own greedy continuation) and the real draft worker (random weights at V4-Flash
#     drafter shapes, on cuda:1 beside the far expert worker, under MPS), sources FULLSIZE_SPEC_SOURCES,
#     width FULLSIZE_SPEC_WIDTH (5); caps FULLSIZE_SPEC_S and FULLSIZE_IPCSPEC_S (110 s each);
#   gpu1spec3 / gpu1spec6: the same with oracle drafts on the first 3 / 6 layers, with --spec-diagnose
#     (plain and verify top-2 logprobs: where outputs part, and by what margin); caps
#     FULLSIZE_SPEC3_S (60 s) and FULLSIZE_SPEC6_S (45 s);
#   gpu1nostage: the attention side's Dispatches sent from their own host tensors (no staging pool).
set -u
export CUDA_MPS_PIPE_DIRECTORY=/tmp/moemesh-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moemesh-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS did not start"
collect() {  # every configuration's JSON so far (also when run_all.sh's cap ends this script mid-run)
  for d in /tmp/fs-*-out; do
    [ -d "$d" ] || continue
    name=$(basename "$d" -out); name=${name#fs-}
    for f in "$d"/*.json; do [ -e "$f" ] && cp "$f" "$RESULTS_DIR/$(basename "$f" | sed "s/^fullsize-/fullsize-$name-/")"; done
  done
}
rm -rf /tmp/fs-*-out
trap 'collect; echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
trap 'exit 143' TERM  # a cap from run_all.sh still runs the EXIT trap (MPS stopped)
LAYERS="${FULLSIZE_LAYERS:-43}"
BUDGET="${FULLSIZE_BUDGET_GIB:-$(( 100 * LAYERS / 43 ))}"
CONTEXT="${FULLSIZE_CONTEXT:-256}"
CONFIGS="${FULLSIZE_CONFIGS:-gpu1spec gpu1ipcspec}"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
NCPU=$(nproc)
echo "torch devices: $NGPU; cpus: $NCPU; mem: $(free -g | awk '/Mem:/ {print $2}') GiB; layers $LAYERS budget ${BUDGET}GiB context $CONTEXT"
python3 -c "import zmq; print('pyzmq', zmq.__version__, 'libzmq', zmq.zmq_version())"
CKPT="${FULLSIZE_CHECKPOINT:-/tmp/moemesh-fullsize-$LAYERS}"
if [ ! -e "$CKPT/model.safetensors.index.json" ]; then
  echo "--- fullsize: $(date -u +%H:%M:%S) writing the random checkpoint ($LAYERS layers + DSpark stages) to $CKPT"
  python3 -m moemesh.cli bench make-checkpoint --preset v4-flash --layers "$LAYERS" --dspark --out "$CKPT" 2>&1 | tail -n 3
fi
SECONDS=0
if [ "${FULLSIZE_TEST:-0}" = 1 ]; then
  echo "--- fullsize: $(date -u +%H:%M:%S) CUDA test"
  timeout -k 5 25 python3 -m pytest -x -q -p no:cacheprovider tests/test_bench_fullsize.py -k gpu 2>&1 | tail -n 15
fi
run_config() {  # NAME FAR_DEVICE CAP_S EXTRA...
  local name="$1" far="$2" cap="$3"; shift 3
  echo "--- fullsize: $(date -u +%H:%M:%S) $name (${SECONDS}s used, cap ${cap}s)"
  rm -rf "/tmp/fs-$name" "/tmp/fs-$name-out"; mkdir -p "/tmp/fs-$name-out"
  timeout -k 5 "$cap" python3 -m moemesh.bench.fullsize --experts-on "$far" --layers "$LAYERS" --checkpoint "$CKPT" \
    --gpu-expert-budget "${BUDGET}GiB" --routing uniform,skewed --decode-steps 5 --warmup-steps 2 \
    --context "$CONTEXT" --max-context-tokens "${FULLSIZE_MAX_CONTEXT:-8192}" --run-dir "/tmp/fs-$name" --out-dir "/tmp/fs-$name-out" "$@" 2>&1 \
    | grep -v '^  step' | cut -c1-600 | tail -n 40
  for f in "/tmp/fs-$name-out"/*.json; do [ -e "$f" ] && cp "$f" "$RESULTS_DIR/$(basename "$f" | sed "s/^fullsize-/fullsize-$name-/")"; done
  for f in "/tmp/fs-$name"/*.stderr; do
    [ -e "$f" ] || continue
    echo "== $f"; grep -v '"level": "info"' "$f" | tail -n 4 | cut -c1-500
  done
}
cpu_result() {  # NAME: the one-GPU-plus-CPU result to compare with (graphs runs with the graphs one)
  ls "/tmp/fs-$1-out"/fullsize-*-2*.json "/tmp/fs-$1-out/fullsize-partial.json" 2>/dev/null | head -n 1
}
for config in $CONFIGS; do
  graphs=""; case "$config" in *graphs) graphs="--cuda-graphs" ;; esac
  case "$config" in
    cpu|cpugraphs)
      run_config "$config" cpu "${FULLSIZE_CPU_S:-70}" --batch "${FULLSIZE_CPU_BATCH:-1,8}" \
        --run-budget-s "${FULLSIZE_RUN_BUDGET_S:-8}" \
        --cpu-threads "${FULLSIZE_CPU_THREADS:-16}" $graphs ;;
    gpu1|gpu1ipc|gpu1graphs|gpu1ipcgraphs)
      if [ "$NGPU" -lt 2 ]; then echo "$config: needs two GPUs, this machine has $NGPU"; continue; fi
      CMP=$(cpu_result cpu${graphs:+graphs})
      case "$config" in
        gpu1ipc*) plane=cuda_ipc; cap="${FULLSIZE_IPC_S:-130}" ;;
        *) plane=zmq; cap="${FULLSIZE_GPU1_S:-100}" ;;
      esac
      prefill="${FULLSIZE_PREFILL:-2048,8192}"
      case "$config" in gpu1graphs) prefill="" ;; esac  # prefill runs eagerly: gpu1 / gpu1prefill measure it
      case "$config" in *graphs) cap="${FULLSIZE_GRAPHS_S:-$cap}" ;; esac
      run_config "$config" cuda:1 "$cap" --data-plane "$plane" --batch "${FULLSIZE_GPU1_BATCH:-1,8,64}" \
        --prefill "$prefill" ${CMP:+--compare "$CMP"} $graphs ;;
    gpu1prefill)  # the 8K prefill over ZeroMQ
      if [ "$NGPU" -lt 2 ]; then continue; fi
      run_config gpu1prefill cuda:1 "${FULLSIZE_PREFILL_S:-70}" --data-plane zmq --batch "" --prefill 8192 ;;
    gpu1spec|gpu1ipcspec)  # speculation: oracle (full acceptance, output = plain) and the real draft worker
      if [ "$NGPU" -lt 2 ]; then echo "$config: needs two GPUs, this machine has $NGPU"; continue; fi
      case "$config" in
        gpu1ipcspec) plane=cuda_ipc; cap="${FULLSIZE_IPCSPEC_S:-110}" ;;
        *) plane=zmq; cap="${FULLSIZE_SPEC_S:-110}" ;;
      esac
      run_config "$config" cuda:1 "$cap" --data-plane "$plane" --batch "${FULLSIZE_SPEC_BATCH:-1,8}" \
        --routing uniform --warmup-steps 1 --decode-steps 5 --speculation "${FULLSIZE_SPEC_SOURCES:-oracle,drafter}" \
        --spec-width "${FULLSIZE_SPEC_WIDTH:-5}" --draft-device cuda:1 ;;
    gpu1spec3|gpu1spec6)  # oracle drafts at reduced depth, with the logprob diagnosis
      if [ "$NGPU" -lt 2 ]; then continue; fi
      depth=${config#gpu1spec}
      case "$depth" in 3) cap="${FULLSIZE_SPEC3_S:-60}" ;; *) cap="${FULLSIZE_SPEC6_S:-45}" ;; esac
      run_config "$config" cuda:1 "$cap" --layers "$depth" --gpu-expert-budget "$(( 100 * depth / 43 + 1 ))GiB" \
        --data-plane zmq --batch 1,8 --routing uniform --warmup-steps 1 --decode-steps 5 \
        --speculation oracle --spec-width "${FULLSIZE_SPEC_WIDTH:-5}" --spec-diagnose ;;
    gpu1ipcprefill)  # the 8K prefill over CUDA IPC
      if [ "$NGPU" -lt 2 ]; then continue; fi
      run_config gpu1ipcprefill cuda:1 "${FULLSIZE_IPCPREFILL_S:-80}" --data-plane cuda_ipc --batch "" --prefill 8192 ;;
    gpu1nostage)  # diagnostic: the attention side's Dispatches sent from their own host tensors (no staging pool)
      if [ "$NGPU" -lt 2 ]; then continue; fi
      run_config gpu1nostage cuda:1 "${FULLSIZE_NOSTAGE_S:-25}" --batch 1,8 --dispatch-staging off ;;
    *) echo "unknown configuration $config" ;;
  esac
done
echo "--- fullsize: $(date -u +%H:%M:%S) done (${SECONDS}s)"
