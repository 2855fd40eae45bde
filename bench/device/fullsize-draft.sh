#!/usr/bin/env bash
# The DSpark drafter at V4-Flash shapes loaded from a random checkpoint, on cuda:1 (free on the
# two-GPU machine; cuda:0 if there is only one): the CUDA check of tests/test_draft_random_checkpoint.py first
# (proposals valid and repeatable), then the checkpoint written (3 main layers + the DSpark stages, about
# 25 GB, cached under $MOEMESH_CHECKPOINT_CACHE), then bench.fullsize_draft (propose for 1, 8, 64 requests with full 128-position rings, greedy and sampled,
# and add_features, against the weight-bandwidth floor measured in the same run). One process: no MPS.
# Run by bench/device/run_all.sh from the repo root with PYTHONPATH set (cap 150 s).
set -u
: "${RESULTS_DIR:=$PWD/bench/results}"
mkdir -p "$RESULTS_DIR"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(0))"
DEVICE=cuda:1
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then DEVICE=cuda:0; fi

echo "=== CUDA checks (tests/test_draft_random_checkpoint.py -k cuda)"
timeout 45 python3 -m pytest -x -q -p no:cacheprovider tests/test_draft_random_checkpoint.py -k cuda 2>&1 | tail -n 25
echo "pytest rc=${PIPESTATUS[0]}"

export MOEMESH_CHECKPOINT_CACHE="${MOEMESH_CHECKPOINT_CACHE:-/tmp/moemesh-checkpoints}"
echo "=== random checkpoint for bench.fullsize_draft (written once)"
python3 -c "from moemesh.bench.fullsize_draft import hub_config; from moemesh.bench.random_checkpoint import cached_checkpoint; \
cached_checkpoint(hub_config(False))" 2>&1 | tail -n 3
echo "=== bench.fullsize_draft on $DEVICE (V4-Flash drafter: 3 stages x 256 FP4 experts)"
timeout 95 python3 -m moemesh.bench.fullsize_draft --device "$DEVICE" --repeats 5 --warmup 2 --probe --out-dir "$RESULTS_DIR"
echo "bench rc=$?"
