"""`python -m moemesh.tools.corpus.build_dataset --out DIR [--seq-len 1024]`

Writes the packed training and validation streams of the default model:
  train_ids.npy, train_loss_mask.npy            [N, seq_len] uint16 / uint8
  validation_ids.npy, validation_loss_mask.npy  likewise, held-out chapters
  manifest.json                                 shapes, counts, seeds, held-out chapters,
                                                tokenizer hash, corpus figures
Load with `numpy.load(path)` (plain arrays; no pickle). Needs the `bible` program.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


def build_arg_parser() -> argparse.ArgumentParser:
    from moemesh.tools.corpus.tokenizer import DEFAULT_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1611)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="where tokenizer.json is")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    import numpy as np

    from moemesh.tools.corpus.corpus_texts import CorpusConfig, build_corpus_texts
    from moemesh.tools.corpus.dataset import DatasetConfig, build_stream
    from moemesh.tools.corpus.kjv import CorpusError
    from moemesh.tools.corpus.stats import corpus_figures
    from moemesh.tools.corpus.tokenizer import TOKENIZER_FILE, load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
    config = DatasetConfig(seq_len=args.seq_len, seed=args.seed)
    try:
        texts = build_corpus_texts(CorpusConfig())
    except CorpusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    split = texts.split
    train = build_stream(tokenizer, split.train_verses, texts.train_chat, config, shuffle=True)
    validation = build_stream(tokenizer, split.validation_verses, texts.validation_chat, config, shuffle=False)

    args.out.mkdir(parents=True, exist_ok=True)
    streams = {"train": train, "validation": validation}
    for name, stream in streams.items():
        np.save(args.out / f"{name}_ids.npy", stream.token_ids, allow_pickle=False)
        np.save(args.out / f"{name}_loss_mask.npy", stream.loss_mask, allow_pickle=False)
    tokenizer_bytes = (args.model_dir / TOKENIZER_FILE).read_bytes()
    manifest = {
        "format_version": FORMAT_VERSION,
        "seq_len": config.seq_len,
        "seed": config.seed,
        "max_verses_per_chunk": config.max_verses_per_chunk,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "tokenizer_sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
        "token_dtype": "uint16",
        "mask_dtype": "uint8",
        "streams": {
            name: {
                "ids_file": f"{name}_ids.npy",
                "loss_mask_file": f"{name}_loss_mask.npy",
                "num_windows": int(stream.token_ids.shape[0]),
                "num_tokens": stream.num_tokens,
                "num_running_text_tokens": stream.num_running_tokens,
                "num_chat_tokens": stream.num_chat_tokens,
                "num_target_tokens": int(stream.loss_mask.sum()),
            }
            for name, stream in streams.items()
        },
        "validation_chapters": [f"{book} {chapter}" for book, chapter in split.validation_chapters],
        "figures": corpus_figures(tokenizer, texts),
    }
    (args.out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log.info("corpus.dataset_saved", out=str(args.out), **{f"{k}_windows": v.token_ids.shape[0] for k, v in streams.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
