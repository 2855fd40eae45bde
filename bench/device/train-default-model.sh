#!/usr/bin/env bash
# Trains the default model on cuda:0 for TRAIN_SECONDS, continuing from the checkpoint in the repo, and
# sends the new checkpoint back. Run by bench/device/run_all.sh (cap at least TRAIN_SECONDS + 90: start,
# data, export and the final evaluation come on top), e.g. from the repo root:
#   bash bench/device/run_all.sh train-default-model:570        (TRAIN_SECONDS=470 by default)
# Environment (all optional):
#   TRAIN_SECONDS     whole training run: target + drafter + export (default 470)
#   TRAIN_INIT_FROM   hub checkpoint to continue from (default models/kjv-dsv4-mini); "none": fresh weights;
#                     "last": the checkpoint the previous run on this (still warm) machine left in $LAST
#   TRAIN_SIZE        model size when TRAIN_INIT_FROM=none (default recite, tools/train/settings.py)
#   TRAIN_DATA_PACK   the dataset as one file (default .traindata/kjv-recite.pack, tools.train.data_pack;
#                     an ignored path: pass it in the device call's carry); a built .traindata/kjv-recite/ is
#                     used instead when present
#   TRAIN_BATCH       windows of 1024 tokens per step (default 64)
#   TRAIN_TARGET_SHARE share of TRAIN_SECONDS for the target (default 0.8; the drafter gets the rest)
#   TRAIN_COMPILE     1: torch.compile the training steps (compile time counts; falls back to eager on error)
#   TRAIN_EXTRA       more arguments for `python -m moemesh.tools.train` (e.g. "--target-lr 0.001")
# Output: the training log (JSON lines: tok/s, loss curve, validation, export) in $RESULTS_DIR (packed into
# device.tar.gz by run_all.sh), and the exported checkpoint directory (hub format, MODEL_CARD.md,
# train_log.jsonl, train_history.json, tokenizer) as a tar in 15 MiB pieces $OUT/checkpoint.tar.part-NN.
# Back home: rm models/kjv-dsv4-mini/model-*.safetensors && cat checkpoint.tar.part-* | tar xf - -C models/kjv-dsv4-mini
set -u
: "${OUT:?OUT must be set}"
: "${RESULTS_DIR:=$OUT/results}"
mkdir -p "$RESULTS_DIR"
TRAIN_SECONDS=${TRAIN_SECONDS:-470}
TRAIN_INIT_FROM=${TRAIN_INIT_FROM:-models/kjv-dsv4-mini}
TRAIN_SIZE=${TRAIN_SIZE:-recite}
TRAIN_DATA_PACK=${TRAIN_DATA_PACK:-.traindata/kjv-recite.pack}
TRAIN_BATCH=${TRAIN_BATCH:-64}
TRAIN_TARGET_SHARE=${TRAIN_TARGET_SHARE:-0.8}
CKPT=/tmp/train-default-model/ckpt
LAST=/tmp/train-default-model-last  # outlives the run: a follow-up call on the warm machine continues from it
[ "$TRAIN_INIT_FROM" = last ] && TRAIN_INIT_FROM=$LAST
rm -rf /tmp/train-default-model && mkdir -p /tmp/train-default-model
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ -f .traindata/kjv-recite/manifest.json ]; then
  DATA=.traindata/kjv-recite
elif [ -f "$TRAIN_DATA_PACK" ]; then
  DATA=/tmp/train-default-model/data
  python3 -m moemesh.tools.train.data_pack unpack --pack "$TRAIN_DATA_PACK" --data-dir "$DATA" || exit 1
else
  echo "no dataset: build .traindata/kjv-recite (tools.train.build_data) and pack it to $TRAIN_DATA_PACK"; exit 1
fi

args=(--out "$CKPT" --data-dir "$DATA" --time-budget-s "$TRAIN_SECONDS" --batch-size "$TRAIN_BATCH"
      --target-time-share "$TRAIN_TARGET_SHARE" --log-every-steps 10)
if [ "$TRAIN_INIT_FROM" = none ]; then
  args+=(--size "$TRAIN_SIZE")
else
  args+=(--init-from "$TRAIN_INIT_FROM")
fi
[ "${TRAIN_COMPILE:-0}" = 1 ] && args+=(--compile)
# shellcheck disable=SC2206
[ -n "${TRAIN_EXTRA:-}" ] && args+=(${TRAIN_EXTRA})
echo "=== python3 -m moemesh.tools.train ${args[*]}"
python3 -m moemesh.tools.train "${args[@]}"
rc=$?
cp "$CKPT/train_log.jsonl" "$RESULTS_DIR/train-default-model-log.jsonl" 2>/dev/null
[ -f "$CKPT/train_history.json" ] && cp "$CKPT/train_history.json" "$RESULTS_DIR/"
if [ ! -f "$CKPT/config.json" ]; then
  echo "training failed (rc=$rc): no checkpoint sent back"; exit 1
fi
# an exported checkpoint is sent back even when a figure after the export failed (rc kept for the caller)
[ "$rc" != 0 ] && echo "TRAINING RUN FAILED AFTER THE EXPORT (rc=$rc): the checkpoint below has no model card"
python3 - "$CKPT/train_log.jsonl" <<'EOF'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for e in events:
    if e["event"] in ("target.steps_fixed", "target.done", "target.validation", "drafter.done",
                      "drafter.validation_acceptance", "export.written", "export.validation", "export.recitation"):
        print(json.dumps(e)[:400])
curve = [(e["step"], e["loss"], e.get("tokens_per_s")) for e in events if e["event"] == "target.step"]
print("loss curve (step, loss, tok/s):", curve[:: max(1, len(curve) // 12)] + curve[-1:])
EOF
ls -la "$CKPT"
rm -rf "$LAST" && cp -r "$CKPT" "$LAST"
tar cf - -C "$CKPT" . | split -b 15M -d - "$OUT/checkpoint.tar.part-"
ls -la "$OUT"
exit $rc
