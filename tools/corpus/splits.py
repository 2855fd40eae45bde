"""Train/validation split of the KJV by whole chapters.

Why whole chapters: neighbouring verses share names, phrases and parallel structure, so a
verse-level hold-out would leak; a held-out chapter is text the model has never seen.

How: list the 1,189 chapters in canonical order and take every `stride`-th one
(stride = round(1 / validation_fraction)) starting at an offset drawn from
`random.Random(seed)`. This spreads the hold-out evenly over the whole Bible (law, history,
poetry, prophets, gospels, letters) rather than clustering it, and depends only on the seed
and the book table, not on the text, so it is identical on every machine. A chapter listed
in `protected_chapters` (the passages demos and tests recite) is never held out; the next
unprotected chapter takes its place.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moemesh.tools.corpus.books import BOOKS
from moemesh.tools.corpus.kjv import Verse

ChapterKey = tuple[str, int]  # (canonical book name, chapter)

DEFAULT_PROTECTED_CHAPTERS: tuple[ChapterKey, ...] = (
    ("Genesis", 1),
    ("Psalms", 23),
    ("Psalms", 119),
    ("Matthew", 5),
    ("Matthew", 6),
    ("John", 1),
    ("John", 3),
    ("John", 11),
    ("1 Corinthians", 13),
    ("Philippians", 4),
    ("Revelation", 22),
)


@dataclass(frozen=True)
class SplitConfig:
    seed: int = 1611
    validation_fraction: float = 0.025  # ~30 of 1,189 chapters
    protected_chapters: tuple[ChapterKey, ...] = DEFAULT_PROTECTED_CHAPTERS


@dataclass(frozen=True)
class CorpusSplit:
    train_verses: tuple[Verse, ...]
    validation_verses: tuple[Verse, ...]
    validation_chapters: tuple[ChapterKey, ...]


def all_chapters() -> list[ChapterKey]:
    """Every chapter in canonical order, from the book table."""
    return [(book.name, chapter) for book in BOOKS for chapter in range(1, book.num_chapters + 1)]


def validation_chapters(config: SplitConfig) -> tuple[ChapterKey, ...]:
    """The held-out chapters, in canonical order (see the module docstring)."""
    if not 0.0 < config.validation_fraction < 0.5:
        raise ValueError(f"validation_fraction must be in (0, 0.5), got {config.validation_fraction}")
    chapters = all_chapters()
    protected = set(config.protected_chapters)
    stride = max(2, round(1.0 / config.validation_fraction))
    offset = random.Random(config.seed).randrange(stride)
    chosen: list[ChapterKey] = []
    for position in range(offset, len(chapters), stride):
        # Walk forward past protected chapters, but never into the next stride's slot.
        for candidate in range(position, min(position + stride, len(chapters))):
            key = chapters[candidate]
            if key not in protected and key not in chosen:
                chosen.append(key)
                break
    return tuple(chosen)


def split_verses(verses: Sequence[Verse], config: SplitConfig) -> CorpusSplit:
    held_out = validation_chapters(config)
    held_out_set = set(held_out)
    train = tuple(v for v in verses if v.chapter_key not in held_out_set)
    validation = tuple(v for v in verses if v.chapter_key in held_out_set)
    return CorpusSplit(train, validation, held_out)


def verse_line(verse: Verse) -> str:
    """One line of running text: "John 3:16 For God so loved the world, ...\\n"."""
    return f"{verse.reference} {verse.text}\n"


def running_text(verses: Iterable[Verse]) -> str:
    """Verses as running text, one referenced verse per line."""
    return "".join(verse_line(v) for v in verses)
