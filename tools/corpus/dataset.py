"""Token streams for training the default model, packed into fixed-length windows.

Units (each a self-contained text that starts with BOS and ends with EOS):
- running text: each chapter is cut into chunks of 1..`max_verses_per_chunk` consecutive
  verses (lengths drawn from the seed), each verse a line "John 3:16 For God so ...\\n".
  Short chunks make "BOS <reference>" a common start, which is what a completion prompt
  looks like, and teach the model to stop.
- chat examples (`chat_examples`), with the loss mask set only on the assistant's answer.

Oversampling (`DatasetConfig.oversample`, off by default): the verses of a fixed list of chapters
(the well-known ones of `tools.corpus.splits.DEFAULT_PROTECTED_CHAPTERS`, which are never held
out) get extra units: `num_running_copies` more chunkings of their running text (each cut with
its own seed) and `num_chat_variants` more differently seeded sets of chat examples (one reference
and one continuation example per verse each). Why: the model is trained for a few minutes, about
one pass over the Bible, too few sightings for any verse to be memorised; repeating a small,
documented set makes exactly those verses recitable while the rest stays general text.

Training units are shuffled with `random.Random(seed)`, concatenated, and cut into windows
of `seq_len` tokens; the last window is right-padded with PAD (mask 0). Validation units
(held-out chapters) are packed the same way, unshuffled. A window of `seq_len` tokens gives
`seq_len - 1` next-token predictions: inputs `w[:-1]`, targets `w[1:]`, weights `mask[1:]`.

Mask semantics: `loss_mask[i] == 1` when token i is a training target. Running-text tokens
are all targets; in a chat example only the answer tokens (EOS included) are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from moemesh.common.chat import tokens as chat_tokens
from moemesh.tools.corpus.chat_examples import ChatExample, ChatExampleConfig, build_chat_examples
from moemesh.tools.corpus.kjv import Verse, group_by_chapter
from moemesh.tools.corpus.special_tokens import PAD_ID
from moemesh.tools.corpus.splits import DEFAULT_PROTECTED_CHAPTERS, ChapterKey, verse_line

TOKEN_DTYPE = np.uint16  # vocab 12,288 < 65,536
MASK_DTYPE = np.uint8


@dataclass(frozen=True)
class OversampleConfig:
    """Extra copies of the units of `chapters` (see the module docstring)."""

    chapters: tuple[ChapterKey, ...] = DEFAULT_PROTECTED_CHAPTERS
    num_running_copies: int = 8  # extra chunkings of each chapter's running text
    num_chat_variants: int = 24  # extra (reference + continuation) example sets per verse


@dataclass(frozen=True)
class DatasetConfig:
    seq_len: int = 1024
    seed: int = 1611
    max_verses_per_chunk: int = 16
    oversample: OversampleConfig | None = None  # None: every unit once


@dataclass(frozen=True)
class Unit:
    """One text to tokenize; `target_start` is the character offset from which tokens are
    loss targets (0 for running text, the answer start for chat)."""

    text: str
    target_start: int


@dataclass(frozen=True)
class PackedStream:
    token_ids: np.ndarray  # [N, L] uint16; N windows, L = seq_len
    loss_mask: np.ndarray  # [N, L] uint8
    num_tokens: int  # real tokens before padding
    num_running_tokens: int
    num_chat_tokens: int


def running_text_units(verses: Sequence[Verse], config: DatasetConfig, copy_index: int = 0) -> list[Unit]:
    """Chapters cut into seeded chunks; the cut of a chapter depends only on the seed, the
    chapter's reference and `copy_index` (0 for the base copy, n > 0 for oversampled copies),
    not on which other chapters are present."""
    units = []
    salt = "" if copy_index == 0 else f"{copy_index}/"
    for (book, chapter), chapter_verses in group_by_chapter(verses).items():
        rng = random.Random(f"{config.seed}/chunks/{salt}{book} {chapter}")
        position = 0
        while position < len(chapter_verses):
            size = rng.randint(1, config.max_verses_per_chunk)
            chunk = chapter_verses[position : position + size]
            text = chat_tokens.BOS + "".join(verse_line(v) for v in chunk) + chat_tokens.EOS
            units.append(Unit(text, 0))
            position += size
    return units


def chat_units(examples: Sequence[ChatExample]) -> list[Unit]:
    return [Unit(example.text, example.answer_start) for example in examples]


def oversampled_units(verses: Sequence[Verse], config: DatasetConfig) -> tuple[list[Unit], list[Unit]]:
    """(running, chat) extra units for the verses of `config.oversample.chapters`; none when
    oversampling is off or no verse falls in those chapters (a validation split never has any)."""
    if config.oversample is None:
        return [], []
    wanted = set(config.oversample.chapters)
    chosen = [v for v in verses if v.chapter_key in wanted]
    running = [unit for copy_index in range(1, config.oversample.num_running_copies + 1)
               for unit in running_text_units(chosen, config, copy_index)]
    chat = [unit for variant in range(1, config.oversample.num_chat_variants + 1)
            for unit in chat_units(build_chat_examples(chosen, ChatExampleConfig(seed=config.seed, variant=variant)))]
    return running, chat


def tokenize_units(tokenizer: Tokenizer, units: Sequence[Unit]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss mask) per unit. Units already hold BOS/EOS as text, so no special tokens
    are added here."""
    encodings = tokenizer.encode_batch([unit.text for unit in units], add_special_tokens=False)
    result = []
    for unit, encoding in zip(units, encodings, strict=True):
        ids = np.asarray(encoding.ids, dtype=TOKEN_DTYPE)
        starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        mask = (starts >= unit.target_start).astype(MASK_DTYPE)
        result.append((ids, mask))
    return result


def pack(pieces: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Concatenate and cut into [N, seq_len] windows, right-padding the last with PAD."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, TOKEN_DTYPE)
    mask = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, MASK_DTYPE)
    num_tokens = int(ids.size)
    num_windows = -(-num_tokens // seq_len)
    padded_ids = np.full(num_windows * seq_len, PAD_ID, dtype=TOKEN_DTYPE)
    padded_mask = np.zeros(num_windows * seq_len, dtype=MASK_DTYPE)
    padded_ids[:num_tokens] = ids
    padded_mask[:num_tokens] = mask
    return padded_ids.reshape(num_windows, seq_len), padded_mask.reshape(num_windows, seq_len), num_tokens


def build_stream(
    tokenizer: Tokenizer,
    verses: Sequence[Verse],
    examples: Sequence[ChatExample],
    config: DatasetConfig,
    *,
    shuffle: bool,
) -> PackedStream:
    extra_running, extra_chat = oversampled_units(verses, config)
    running = tokenize_units(tokenizer, running_text_units(verses, config) + extra_running)
    chat = tokenize_units(tokenizer, chat_units(examples) + extra_chat)
    pieces = running + chat
    if shuffle:
        random.Random(config.seed).shuffle(pieces)
    token_ids, loss_mask, num_tokens = pack(pieces, config.seq_len)
    return PackedStream(
        token_ids=token_ids,
        loss_mask=loss_mask,
        num_tokens=num_tokens,
        num_running_tokens=sum(int(p[0].size) for p in running),
        num_chat_tokens=sum(int(p[0].size) for p in chat),
    )
