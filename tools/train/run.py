"""`python -m moemesh.tools.train --out models/kjv-dsv4-mini [--smoke] ...`: the one training command.

Steps (each logged as a JSON line to `<out>/train_log.jsonl`):
1. dataset: read the pre-built token windows (`--data-dir`); build them with
   `tools.train.build_data` (well-known chapters oversampled) when missing (needs `bible`);
2. target: AdamW, linear warm-up + cosine, bf16 autocast on CUDA, masked next-token CE on the
   training windows (running text + chat answers); router biases balanced aux-loss-free;
3. validation loss / perplexity on the held-out chapters (float weights);
4. drafter: DSpark distillation from the frozen target (`tools.train.drafter`);
5. export (FP8 / FP4 / bf16 / fp32 hub format) and re-evaluation of the exported files through
   the model core's reader + reference model (the figures of the model card), greedy recitation;
6. MODEL_CARD.md.
Seeded: data order, initialisation and anchors come from `--seed`. With `--target-steps` /
`--drafter-steps` unset, the step counts are fixed after timing the first steps so the run fits
`--time-budget-s`; the chosen counts are logged (pass them back to repeat the run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / ".traindata" / "kjv-recite"
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "models" / "kjv-dsv4-mini"
LOG_FILE = "train_log.jsonl"
HISTORY_FILE = "train_history.json"  # one entry per training run that led to this checkpoint


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moemesh.tools.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="pre-built dataset (manifest.json)")
    parser.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER_DIR)
    parser.add_argument("--no-tokenizer-copy", action="store_true", help="do not copy tokenizer files into --out")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 20 target steps (CPU check)")
    parser.add_argument("--size", choices=("full", "recite"), help="model size when not resuming (default full)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="hub checkpoint to continue training from (its config; drafter too when it has mtp.*)")
    parser.add_argument("--no-qat", action="store_true", help="train float weights (default: on the FP8/FP4 values)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the training steps (CUDA)")
    parser.add_argument("--target-lr", type=float)
    parser.add_argument("--drafter-lr", type=float)
    parser.add_argument("--target-warmup-steps", type=int)
    parser.add_argument("--log-every-steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--target-steps", type=int)
    parser.add_argument("--drafter-steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--time-budget-s", type=float)
    parser.add_argument("--target-time-share", type=float, help="share of the time budget for the target")
    parser.add_argument("--precision", choices=("bf16", "fp32"))
    parser.add_argument("--core-attention", action="store_true",
                        help="train through the model core's per-sequence attention instead of the batched path")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    return parser


class JsonLog:
    """Append-only JSON lines: {"t": seconds since start, "event": ..., **fields}; also to stdout."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "w", encoding="utf-8")
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __call__(self, event: str, **fields) -> None:
        line = json.dumps({"t": round(self.elapsed(), 2), "event": event, **fields})
        self.handle.write(line + "\n")
        self.handle.flush()
        print(line, flush=True)


def settings_from_args(args):
    from moemesh.tools.train.settings import TrainSettings

    settings = TrainSettings.smoke() if args.smoke else TrainSettings()
    overrides = {"seed": args.seed, "target_steps": args.target_steps, "drafter_steps": args.drafter_steps,
                 "batch_size": args.batch_size, "time_budget_s": args.time_budget_s, "precision": args.precision,
                 "target_time_share": args.target_time_share,
                 "batched_attention": False if args.core_attention else None,
                 "size": None if args.smoke else args.size, "qat": False if args.no_qat else None,
                 "compile": True if args.compile else None, "target_lr": args.target_lr,
                 "drafter_lr": args.drafter_lr, "target_warmup_steps": args.target_warmup_steps,
                 "log_every_steps": args.log_every_steps}
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def ensure_dataset(data_dir: Path, log: JsonLog) -> dict:
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.exists():
        from moemesh.tools.train import build_data

        log("train.dataset_build", data_dir=str(data_dir))
        if build_data.main(["--out", str(data_dir), "--seq-len", "1024"]) != 0:
            raise SystemExit("dataset build failed")
    return json.loads(manifest_path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    import numpy as np
    import torch

    from moemesh.common.model.config import ModelConfig
    from moemesh.tools.train.loops import train_drafter, train_target
    from moemesh.tools.train.report import finish_run
    from moemesh.tools.train.settings import model_config_dict

    settings = settings_from_args(args)
    history = read_history(args.init_from)
    log = JsonLog(args.out / LOG_FILE)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and settings.precision == "bf16":
        settings = dataclasses.replace(settings, precision="fp32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(settings.seed)
    manifest = ensure_dataset(args.data_dir, log)
    data = {}
    for split in ("train", "validation"):
        stream = manifest["streams"][split]
        ids = np.load(args.data_dir / stream["ids_file"], allow_pickle=False)
        mask = np.load(args.data_dir / stream["loss_mask_file"], allow_pickle=False)
        if split == "validation":  # training packs its units into settings.seq_len windows itself
            ids, mask = ids[:, : settings.seq_len], mask[:, : settings.seq_len]
        data[split] = (ids, mask)
    if args.init_from is not None:
        from moemesh.tools.train.resume import read_config

        config = read_config(args.init_from)
        if config.vocab_size != manifest["vocab_size"]:
            raise SystemExit(f"{args.init_from}: vocabulary {config.vocab_size} != dataset {manifest['vocab_size']}")
    else:
        config = ModelConfig.from_dict(model_config_dict(settings.size, manifest["vocab_size"]))
    log("train.start", settings=dataclasses.asdict(settings), device=str(device),
        torch_version=torch.__version__, gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        model_config=config.to_hub_dict(), dataset={k: manifest["streams"][k] for k in ("train", "validation")},
        validation_chapters=manifest["validation_chapters"], init_from=str(args.init_from) if args.init_from else None)
    deadline = time.monotonic() + settings.time_budget_s
    target, target_report = train_target(config, settings, data, device, log, deadline, args.init_from)
    drafter, drafter_report = train_drafter(config, settings, target, data, device, log, deadline, args.init_from)
    command = "python -m moemesh.tools.train " + " ".join(sys.argv[1:] if argv is None else argv)
    history.append({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "command": command,
                    "init_from": str(args.init_from) if args.init_from else None, "batch_size": settings.batch_size,
                    "qat": settings.qat, "compile": settings.compile,
                    **{k: target_report[k] for k in ("steps", "seconds", "tokens", "tokens_per_s", "passes")},
                    "drafter_steps": drafter_report["steps"], "validation": target_report["validation_float"]})
    totals = {"runs": len(history), "tokens": sum(h["tokens"] for h in history),
              "passes": round(sum(h["passes"] for h in history), 3),
              "target_seconds": round(sum(h["seconds"] for h in history), 1)}
    finish_run(args, config, settings, target, drafter, data, device, log,
               {"target": target_report, "drafter": drafter_report, "dataset": manifest,
                "history": {"totals": totals, "runs": history}})
    (args.out / HISTORY_FILE).write_text(json.dumps({"totals": totals, "runs": history}, indent=1) + "\n",
                                         encoding="utf-8")
    log("train.history", **totals)
    return 0


def read_history(init_from: Path | None) -> list[dict]:
    """The runs behind the checkpoint trained from (empty for fresh weights or a checkpoint without one)."""
    if init_from is None or not (Path(init_from) / HISTORY_FILE).exists():
        return []
    return json.loads((Path(init_from) / HISTORY_FILE).read_text(encoding="utf-8"))["runs"]


if __name__ == "__main__":
    sys.exit(main())
