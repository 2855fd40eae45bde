"""`python -m moemesh.tools.corpus.build_tokenizer --out models/kjv-dsv4-mini`

Trains the byte-level BPE on the training split (running text + chat examples) and writes
`tokenizer.json` and `tokenizer_config.json`. Needs the `bible` program (bible-kjv).
With `--check-determinism` it trains a second time and fails unless both serialisations
are byte-identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for tokenizer.json/tokenizer_config.json")
    parser.add_argument("--vocab-size", type=int, default=12288, help="total vocabulary, multiple of 128")
    parser.add_argument("--model-max-length", type=int, default=4096)
    parser.add_argument("--check-determinism", action="store_true", help="train twice, compare bytes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    from moemesh.tools.corpus.corpus_texts import CorpusConfig, build_corpus_texts
    from moemesh.tools.corpus.kjv import CorpusError
    from moemesh.tools.corpus.tokenizer import TokenizerConfig, save_tokenizer, tokenizer_json, train_tokenizer

    config = TokenizerConfig(vocab_size=args.vocab_size, model_max_length=args.model_max_length)
    try:
        texts = build_corpus_texts(CorpusConfig()).tokenizer_training_texts()
    except CorpusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts, config)
    log.info("corpus.tokenizer_trained", vocab_size=config.vocab_size, seconds=round(time.perf_counter() - started, 2))
    if args.check_determinism:
        again = train_tokenizer(texts, config)
        if tokenizer_json(again) != tokenizer_json(tokenizer):
            print("error: two trainings on the same text gave different tokenizer.json", file=sys.stderr)
            return 1
        log.info("corpus.tokenizer_deterministic")
    save_tokenizer(tokenizer, config, args.out)
    log.info("corpus.tokenizer_saved", out=str(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
