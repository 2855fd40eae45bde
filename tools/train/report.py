"""End of a training run: export, figures measured on the exported files, MODEL_CARD.md."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moemesh.tools.train.evaluate import (RECITATION_EXPECTED, RECITATION_PROMPT, greedy_continuation,
                                  reference_logits_fn, validation_loss)
from moemesh.tools.train.export import checkpoint_bytes, export_checkpoint, load_reference

CARD_FILE = "MODEL_CARD.md"


def finish_run(args, config, settings, target, drafter, data, device, log, reports: dict) -> None:
    from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID
    from moemesh.tools.corpus.tokenizer import load_tokenizer

    hub = target.hub_state_dict()
    hub.update(drafter.hub_state_dict())
    started = time.monotonic()
    export_checkpoint(args.out, config, hub, None if args.no_tokenizer_copy else args.tokenizer_dir)
    size = checkpoint_bytes(args.out)
    log("export.written", path=str(args.out), seconds=round(time.monotonic() - started, 1), checkpoint_bytes=size)

    model, _reader = load_reference(args.out, device)
    val = validation_loss(reference_logits_fn(model), *data["validation"], settings.eval_batch_size, device)
    log("export.validation", weights="exported (FP8 / FP4 dequantized, float32 reference model)", **val)
    tokenizer = load_tokenizer(args.tokenizer_dir)
    prompt_ids = [BOS_ID] + tokenizer.encode(RECITATION_PROMPT, add_special_tokens=False).ids
    continuation_ids = greedy_continuation(model, prompt_ids, 24, EOS_ID, device)
    continuation = tokenizer.decode(continuation_ids, skip_special_tokens=True)
    recited = continuation.startswith(RECITATION_EXPECTED)
    log("export.recitation", prompt=RECITATION_PROMPT, continuation=continuation, expected=RECITATION_EXPECTED,
        recited=recited)
    reports["export"] = {"checkpoint_bytes": size, "validation": val, "recitation": continuation,
                         "recited": recited}
    card = model_card(config, settings, reports)
    (Path(args.out) / CARD_FILE).write_text(card, encoding="utf-8")
    log("train.done", card=str(Path(args.out) / CARD_FILE))


def training_runs(history: dict) -> str:
    """The runs behind the checkpoint, each with its command (runs continue with `--init-from`)."""
    runs = history["runs"]
    totals = history["totals"]
    lines = [f"Trained in {totals['runs']} run(s), each continuing from the checkpoint the one before wrote "
             f"(`--init-from`; the optimizer state starts afresh each run): {totals['tokens']:,} tokens, "
             f"{totals['passes']:.1f} passes over the training split, {totals['target_seconds']:.0f} s of target "
             "training in all (`train_history.json`).", "",
             "| run | date | device | target steps × windows | s | tokens/s | passes | drafter steps |",
             "|---|---|---|---|---|---|---|---|"]
    for number, run in enumerate(runs, 1):
        lines.append(f"| {number} | {run['date']} | {run.get('gpu') or run['device']} | {run['steps']} × "
                     f"{run['batch_size']} | {run['seconds']:.0f} | {run['tokens_per_s']:,} | {run['passes']:.2f} | "
                     f"{run['drafter_steps']} |")
    lines += ["", "Commands, in order (paths as on the machine that ran them):", "```"]
    lines += [run.get("command", "(command not recorded)") for run in runs]
    lines.append("```")
    return "\n".join(lines)



def _target_line(target: dict, settings) -> str:
    """The last run's target training in the model card's words (a drafter-only run keeps the target as loaded)."""
    if not target["steps"]:
        return "not trained in this run (kept as loaded: `--target-steps 0`)"
    return (f"{target['steps']} steps × {settings.batch_size} windows × {settings.seq_len} tokens at peak lr "
            f"{settings.target_lr}")

def model_card(config, settings, reports: dict) -> str:
    target, drafter, export = reports["target"], reports["drafter"], reports["export"]
    dataset = reports["dataset"]
    val_float, val_export = target["validation_float"], export["validation"]
    acceptance = drafter["validation_acceptance"]
    kinds = {0: "W", 4: "CSA", 128: "HCA"}
    ratios = config.to_hub_dict()["compress_ratios"][: config.num_hidden_layers]
    schedule = ", ".join(kinds[r] for r in ratios)
    slots = " / ".join(f"{acceptance.get(f'accept_slot_{k + 1}', 0.0):.2f}" for k in range(config.dspark.block_size))
    oversample = dataset.get("oversample")
    if oversample:
        data_line = (f"python -m moemesh.tools.train.build_data --out .traindata/kjv-recite --running-copies "
                     f"{oversample['num_running_copies']} --chat-variants {oversample['num_chat_variants']} "
                     f"--reference-examples {dataset.get('reference_examples_per_verse', 1)}")
        oversample_text = (f"\n- Oversampled (to be memorised): the well-known chapters {', '.join(oversample['chapters'])} "
                           f"get {oversample['num_running_copies']} extra chunkings of their running text and "
                           f"{oversample['num_chat_variants']} extra seeded sets of reference + continuation chat "
                           "examples per verse (`tools.corpus.dataset.OversampleConfig`).")
    else:
        data_line = "python -m moemesh.tools.corpus.build_dataset --out .traindata/kjv"
        oversample_text = ""
    return f"""# kjv-dsv4-mini

The default model of moemesh: a DeepSeek-V4-Flash architecture in miniature, trained from scratch on
the King James Bible, with a built-in DSpark drafter (`mtp.0`-`mtp.{config.num_nextn_predict_layers - 1}`). It exists so
that `moemesh serve` has a real, small model of the real architecture and checkpoint format to serve and
test; it is not a useful language model beyond reciting and paraphrasing KJV verses.

## Data
- KJV verses as running text (lines `Book C:V text`, chunks of 1-16 verses) plus chat examples
  (recite / look up verses), from `tools.corpus` (`{data_line}`).{oversample_text}
- Training split: {dataset['streams']['train']['num_tokens']:,} tokens in {dataset['streams']['train']['num_windows']} windows
  of {dataset['seq_len']} ({dataset['streams']['train']['num_running_text_tokens']:,} running text,
  {dataset['streams']['train']['num_chat_tokens']:,} chat); loss on running text and on chat answers only.
- Held out: {len(dataset['validation_chapters'])} whole chapters ({dataset['streams']['validation']['num_tokens']:,} tokens),
  never trained on.

## Architecture
- {config.num_hidden_layers} layers [{schedule}], the first {sum(1 for k in config.mlp_layer_types if k.value == 'hash_moe')} hash-routed (`tid2eid`), the rest learned routers (sqrt-softplus, bias).
- hidden {config.hidden_size}, {config.num_attention_heads} heads × {config.head_dim} (rope {config.qk_rope_head_dim}), q rank {config.q_lora_rank},
  {config.o_groups} output groups × {config.o_lora_rank}; window {config.sliding_window}; CSA ratio {config.csa_compress_ratio} with a
  {config.index_n_heads}-head indexer (dim {config.index_head_dim}, top-{config.index_topk}); HCA ratio {config.hca_compress_ratio}; YaRN on compressed layers.
- mHC with {config.hc_mult} streams ({config.hc_sinkhorn_iters} Sinkhorn iterations); {config.n_routed_experts} routed experts (top-{config.num_experts_per_tok}) + 1 shared,
  width {config.moe_intermediate_size}; vocabulary {config.vocab_size} (the shipped tokenizer).
- DSpark drafter: {config.num_nextn_predict_layers} window-only MoE blocks, features from target layers
  {list(config.dspark.target_layer_ids)} (averaged over HC streams), block size {config.dspark.block_size}, Markov rank
  {config.dspark.markov_rank}, confidence head, mask token {config.dspark.noise_token_id}.
- Storage: FP8 e4m3 with 128×128 ue8m0 scales (dense linears), FP4 e2m1 with per-32 ue8m0 scales
  (routed experts, main and drafter), bf16 embedding / head / norms / compressors / gates, fp32 HC / sink /
  ape / bias, int64 `tid2eid`; {export['checkpoint_bytes'] / 1e6:.1f} MB in all.

## Training
```
{data_line}
```
{training_runs(reports["history"])}
Last run: seed {settings.seed}; AdamW (β 0.9/0.95, weight decay {settings.weight_decay}), warm-up + cosine; target
{_target_line(target, settings)}; drafter
{drafter['steps']} steps of DSpark distillation (0.1 CE + 0.9 TV + 1.0 BCE, slot weights exp(-(k-1)/γ),
{settings.anchors_per_sequence} blocks per window) at peak lr {settings.drafter_lr}; precision {settings.precision}
(bf16 autocast on CUDA). The log is `train_log.jsonl` beside this card. GPU kernels are not bit-deterministic,
so a rerun reproduces the figures closely, not bit for bit.

## Figures (held-out chapters)
| | loss (nats/token) | perplexity |
|---|---|---|
| {'trained weights, quantised as exported (QAT)' if settings.qat else 'float weights after training'} | {val_float['loss']:.3f} | {val_float['perplexity']:.2f} |
| exported checkpoint (FP8 / FP4, reference model, fp32) | {val_export['loss']:.3f} | {val_export['perplexity']:.2f} |

Validation tokens: {val_export['num_tokens']:,} (running text and chat answers of the held-out chapters).

Greedy continuation of `{RECITATION_PROMPT}` (exported weights): `{export['recitation']!s}`
(expected `{RECITATION_EXPECTED}`: {'yes' if export['recited'] else 'no'}).

Drafter, teacher-forced greedy acceptance on held-out text (float weights; blocks whose next
{config.dspark.block_size} tokens are the target's own greedy continuation, {acceptance['num_blocks']} blocks): per slot
{slots}; mean accepted drafts per block {acceptance.get('mean_accepted', 0.0):.2f}. Recitation through the chat endpoint,
speculative acceptance per verify step and expert skew: `moemesh bench default-model`. Training across
device runs, the model size and the measurements: docs/default-model.md.
"""
