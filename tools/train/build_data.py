"""`python -m moemesh.tools.train.build_data --out .traindata/kjv-recite`: the training data of the default
model, with the well-known chapters oversampled.

Same files and manifest as `tools.corpus.build_dataset` (train/validation ids and loss masks,
`manifest.json`), built with `DatasetConfig.oversample` set: the chapters of
`tools.corpus.splits.DEFAULT_PROTECTED_CHAPTERS` (Genesis 1, Psalms 23, Psalms 119, Matthew 5-6,
John 1, 3, 11, 1 Corinthians 13, Philippians 4, Revelation 22; never held out) get
`--running-copies` extra chunkings of their running text and `--chat-variants` extra sets of
reference / continuation chat examples, so a few minutes of training memorise exactly those verses.
Every verse gets `--reference-examples` chat examples that ask for it by reference, each with its own
seeded phrasing (default 3: with one, a model learns each verse's one question rather than the lookup by
reference, docs/default-model.md). The manifest records the oversampling under "oversample" and the
reference examples under "reference_examples_per_verse". Needs the `bible` program.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

DEFAULT_RUNNING_COPIES = 8
DEFAULT_CHAT_VARIANTS = 32
DEFAULT_REFERENCE_EXAMPLES = 3


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moemesh.tools.train.build_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1611)
    parser.add_argument("--running-copies", type=int, default=DEFAULT_RUNNING_COPIES)
    parser.add_argument("--chat-variants", type=int, default=DEFAULT_CHAT_VARIANTS)
    parser.add_argument("--reference-examples", type=int, default=DEFAULT_REFERENCE_EXAMPLES,
                        help="chat examples per verse asking for it by reference, each phrased its own way")
    parser.add_argument("--model-dir", type=Path, default=None, help="where tokenizer.json is (default: the shipped model)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    import numpy as np

    from moemesh.tools.corpus.build_dataset import FORMAT_VERSION, MANIFEST_FILE
    from moemesh.tools.corpus.chat_examples import ChatExampleConfig
    from moemesh.tools.corpus.corpus_texts import CorpusConfig, build_corpus_texts
    from moemesh.tools.corpus.dataset import DatasetConfig, OversampleConfig, build_stream
    from moemesh.tools.corpus.kjv import CorpusError
    from moemesh.tools.corpus.stats import corpus_figures
    from moemesh.tools.corpus.tokenizer import DEFAULT_MODEL_DIR, TOKENIZER_FILE, load_tokenizer

    model_dir = args.model_dir or DEFAULT_MODEL_DIR
    tokenizer = load_tokenizer(model_dir)
    oversample = OversampleConfig(num_running_copies=args.running_copies, num_chat_variants=args.chat_variants)
    config = DatasetConfig(seq_len=args.seq_len, seed=args.seed, oversample=oversample)
    try:
        chat = ChatExampleConfig(seed=args.seed, reference_examples_per_verse=args.reference_examples)
        texts = build_corpus_texts(CorpusConfig(chat=chat))
    except CorpusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    split = texts.split
    held_out = set(split.validation_chapters)
    if held_out & set(oversample.chapters):
        raise SystemExit(f"oversampled chapters are held out: {sorted(held_out & set(oversample.chapters))}")
    streams = {
        "train": build_stream(tokenizer, split.train_verses, texts.train_chat, config, shuffle=True),
        "validation": build_stream(tokenizer, split.validation_verses, texts.validation_chat, config, shuffle=False),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, stream in streams.items():
        np.save(args.out / f"{name}_ids.npy", stream.token_ids, allow_pickle=False)
        np.save(args.out / f"{name}_loss_mask.npy", stream.loss_mask, allow_pickle=False)
    manifest = {
        "format_version": FORMAT_VERSION,
        "seq_len": config.seq_len,
        "seed": config.seed,
        "max_verses_per_chunk": config.max_verses_per_chunk,
        "reference_examples_per_verse": args.reference_examples,
        "oversample": {**dataclasses.asdict(oversample),
                       "chapters": [f"{book} {chapter}" for book, chapter in oversample.chapters]},
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "tokenizer_sha256": hashlib.sha256((model_dir / TOKENIZER_FILE).read_bytes()).hexdigest(),
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
    print(json.dumps({"event": "train.data_built", "out": str(args.out),
                      **{f"{k}_windows": v.token_ids.shape[0] for k, v in streams.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
