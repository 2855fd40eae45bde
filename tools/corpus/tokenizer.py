"""Train, save and load the kjv-dsv4-mini byte-level BPE tokenizer.

Layout of the vocabulary (total `TokenizerConfig.vocab_size`, a multiple of 128 so the
embedding and LM-head rows tile evenly):
  ids 0..31     the fixed special-token table (`special_tokens.SPECIAL_TOKEN_TABLE`)
  ids 32..287   the 256 byte symbols of the ByteLevel alphabet (every UTF-8 string encodes)
  ids 288..     BPE merges learned from the training text

Pipeline: no normaliser (text is kept byte-exact), ByteLevel pre-tokenizer (GPT-2 regex, no
added prefix space), BPE, ByteLevel decoder, so decode(encode(s)) == s for any string. As in
DeepSeek's tokenizer, encoding with `add_special_tokens=True` prepends BOS (id 0); text that
already carries BOS, such as the output of `encode_messages`, must be encoded with
`add_special_tokens=False`.

Determinism: the BPE trainer breaks count ties by the pair itself, so the same text in the
same order gives the same merges (checked: byte-identical across runs and thread counts);
`save_tokenizer` writes the compact JSON form, and `build_tokenizer --check-determinism`
trains twice and compares the bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moemesh.common.chat import tokens as chat_tokens
from moemesh.tools.corpus.special_tokens import (
    BOS_ID,
    MASK,
    NUM_SPECIAL_SLOTS,
    PAD,
    SPECIAL_TOKEN_TABLE,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "kjv-dsv4-mini"

_SPECIAL_SPLIT = re.compile("|".join(re.escape(token.content) for token in SPECIAL_TOKEN_TABLE))


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 12288  # total, special slots included; multiple of 128
    min_frequency: int = 2  # a pair seen once is not worth a merge
    model_max_length: int = 4096


def strip_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    """The pieces of each text between special-token strings.

    Special tokens are whole ids, so BPE must not learn merges across or inside them;
    training on the pieces keeps the chat examples' wording without their markers.
    """
    for text in texts:
        for piece in _SPECIAL_SPLIT.split(text):
            if piece:
                yield piece


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig) -> Tokenizer:
    """Train the BPE on `texts` (in order) and attach the special tokens at their ids."""
    if config.vocab_size % 128 != 0:
        raise ValueError(f"vocab_size must be a multiple of 128, got {config.vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        show_progress=False,
        # Listed first, so the trainer gives them ids 0..NUM_SPECIAL_SLOTS-1 in table order.
        special_tokens=[token.content for token in SPECIAL_TOKEN_TABLE],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(strip_special_tokens(texts), trainer=trainer)
    _attach_added_tokens(tokenizer)
    bos = SPECIAL_TOKEN_TABLE[BOS_ID].content
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
            ),
        ]
    )
    check_tokenizer(tokenizer, config)
    return tokenizer


def _attach_added_tokens(tokenizer: Tokenizer) -> None:
    """Register the table as added tokens (matched whole before pre-tokenization). They are
    already in the BPE vocabulary, so they keep the ids the trainer gave them."""
    for token in SPECIAL_TOKEN_TABLE:
        added = AddedToken(token.content, special=token.special, normalized=False)
        if token.special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])


def check_tokenizer(tokenizer: Tokenizer, config: TokenizerConfig) -> None:
    """Raise unless the vocabulary has the documented size and every table token sits at
    its fixed id and encodes to exactly that one id."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != config.vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {size} entries, not {config.vocab_size}: "
            "the training text is too small for this vocab_size, or min_frequency is too high"
        )
    for token in SPECIAL_TOKEN_TABLE:
        ids = tokenizer.encode(token.content, add_special_tokens=False).ids
        if ids != [token.token_id]:
            raise RuntimeError(f"{token.content!r} encodes to {ids}, expected [{token.token_id}]")
    if tokenizer.token_to_id(tokenizer.id_to_token(NUM_SPECIAL_SLOTS)) != NUM_SPECIAL_SLOTS:
        raise RuntimeError("BPE ids do not start right after the special slots")


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """The canonical serialised form (what `save_tokenizer` writes)."""
    return tokenizer.to_str(pretty=False) + "\n"


def tokenizer_config_dict(config: TokenizerConfig) -> dict:
    """`tokenizer_config.json` in the shape transformers writes: the named special tokens,
    BOS-but-not-EOS insertion, and `added_tokens_decoder` keyed by id string (transformers
    4.x writes that table, 5.x reads it; "PreTrainedTokenizerFast" loads in both)."""
    added_tokens_decoder = {
        str(token.token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token.special,
        }
        for token in SPECIAL_TOKEN_TABLE
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder,
        "backend": "tokenizers",
        "bos_token": chat_tokens.BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": chat_tokens.EOS,
        "extra_special_tokens": {},
        "legacy": False,
        "mask_token": MASK,
        "model_max_length": config.model_max_length,
        "pad_token": PAD,
        "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def save_tokenizer(tokenizer: Tokenizer, config: TokenizerConfig, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TOKENIZER_FILE).write_text(tokenizer_json(tokenizer), encoding="utf-8")
    config_text = json.dumps(tokenizer_config_dict(config), indent=2, ensure_ascii=False) + "\n"
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(config_text, encoding="utf-8")


def load_tokenizer(model_dir: Path = DEFAULT_MODEL_DIR) -> Tokenizer:
    """The shipped tokenizer (`tokenizers.Tokenizer`; no transformers needed)."""
    return Tokenizer.from_file(str(Path(model_dir) / TOKENIZER_FILE))
