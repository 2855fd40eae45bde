"""The texts everything is built from: the split, the running text and the chat examples.

One place decides what "the training text" is, so the tokenizer and the dataset are built
from the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.tools.corpus.chat_examples import ChatExample, ChatExampleConfig, build_chat_examples
from moemesh.tools.corpus.kjv import Verse, load_verses
from moemesh.tools.corpus.splits import CorpusSplit, SplitConfig, split_verses, verse_line


@dataclass(frozen=True)
class CorpusConfig:
    split: SplitConfig = field(default_factory=SplitConfig)
    chat: ChatExampleConfig = field(default_factory=ChatExampleConfig)


@dataclass(frozen=True)
class CorpusTexts:
    split: CorpusSplit
    train_chat: tuple[ChatExample, ...]
    validation_chat: tuple[ChatExample, ...]

    def tokenizer_training_texts(self) -> list[str]:
        """Training running text (one verse line each), then the training chat examples."""
        return [verse_line(v) for v in self.split.train_verses] + [e.text for e in self.train_chat]


def build_corpus_texts(config: CorpusConfig, verses: list[Verse] | None = None) -> CorpusTexts:
    """Split `verses` (default: the whole KJV from `bible`) and build the chat examples of
    each side from that side's verses only."""
    if verses is None:
        verses = load_verses()
    split = split_verses(verses, config.split)
    return CorpusTexts(
        split=split,
        train_chat=tuple(build_chat_examples(split.train_verses, config.chat)),
        validation_chat=tuple(build_chat_examples(split.validation_verses, config.chat)),
    )
