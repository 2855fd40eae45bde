"""Figures about the corpus and tokenizer, for the dataset manifest and reports."""

from __future__ import annotations

from tokenizers import Tokenizer

from moemesh.tools.corpus.corpus_texts import CorpusTexts
from moemesh.tools.corpus.splits import verse_line


def corpus_figures(tokenizer: Tokenizer, texts: CorpusTexts) -> dict:
    """Counts of verses/chapters/examples and tokens per verse (text alone, and as a
    referenced running-text line)."""
    split = texts.split
    verses = split.train_verses + split.validation_verses
    verse_tokens = tokenizer.encode_batch([v.text for v in verses], add_special_tokens=False)
    line_tokens = tokenizer.encode_batch([verse_line(v) for v in verses], add_special_tokens=False)
    num_verse_tokens = sum(len(e.ids) for e in verse_tokens)
    num_line_tokens = sum(len(e.ids) for e in line_tokens)
    num_chars = sum(len(v.text) for v in verses)
    return {
        "num_verses": len(verses),
        "num_train_verses": len(split.train_verses),
        "num_validation_verses": len(split.validation_verses),
        "num_chapters": len({v.chapter_key for v in verses}),
        "num_validation_chapters": len(split.validation_chapters),
        "num_train_chat_examples": len(texts.train_chat),
        "num_validation_chat_examples": len(texts.validation_chat),
        "mean_tokens_per_verse_text": round(num_verse_tokens / len(verses), 3),
        "mean_tokens_per_verse_line": round(num_line_tokens / len(verses), 3),
        "mean_chars_per_token": round(num_chars / num_verse_tokens, 3),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
    }
