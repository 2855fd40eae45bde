"""Verse references: parsing ("Jn 3:16", "1 Cor 13:4", "Song of Songs 2:1") and formatting.

A `Reference` always carries the canonical book name, so two spellings of the same verse
compare equal. `verse` is None for a whole-chapter reference ("Psalm 23").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moemesh.tools.corpus.books import BOOKS, Book, book_by_name, find_book


class ReferenceError(ValueError):
    """A string that is not a reference to an existing book and chapter."""


@dataclass(frozen=True, order=True)
class Reference:
    book_index: int  # canonical order, so references sort in Bible order
    chapter: int
    verse: int | None = None

    @property
    def book(self) -> Book:
        return BOOKS[self.book_index]

    def __str__(self) -> str:
        return format_reference(self.book.name, self.chapter, self.verse)


# book part: optional ordinal, then words (letters, spaces, dots); then chapter[:verse].
# The book part is lazy so "Song of Solomon 2:1" leaves "2:1" to the numbers.
_REFERENCE_RE = re.compile(
    r"""^\s*
    (?P<book>(?:[1-3]|i{1,3}|first|second|third|1st|2nd|3rd)?\s*[a-z][a-z .]*?)
    \.?\s*
    (?P<chapter>\d+)
    (?:\s*[:.]\s*(?P<verse>\d+))?
    \s*$""",
    re.IGNORECASE | re.VERBOSE,
)


def parse_reference(text: str) -> Reference:
    """Parse "John 3:16", "Jn 3.16", "1 Cor 13:4", "I Corinthians 13", "Ps 23".

    Checks that the book exists, that the chapter is within the book, and that the verse
    (when given) is at least 1. Whether the verse exists needs the text; `kjv.load_verses`
    callers check that against their verse table.
    """
    match = _REFERENCE_RE.match(text)
    if match is None:
        raise ReferenceError(f"not a verse reference: {text!r}")
    book = find_book(match["book"])
    if book is None:
        raise ReferenceError(f"unknown book {match['book'].strip()!r} in {text!r}")
    chapter = int(match["chapter"])
    if not 1 <= chapter <= book.num_chapters:
        raise ReferenceError(f"{book.name} has chapters 1-{book.num_chapters}, not {chapter} ({text!r})")
    verse = int(match["verse"]) if match["verse"] is not None else None
    if verse is not None and verse < 1:
        raise ReferenceError(f"verse numbers start at 1 ({text!r})")
    return Reference(book.index, chapter, verse)


def make_reference(book_name: str, chapter: int, verse: int | None = None) -> Reference:
    """A reference from a canonical book name ("1 Corinthians")."""
    return Reference(book_by_name(book_name).index, chapter, verse)


def format_reference(book_name: str, chapter: int, verse: int | None = None) -> str:
    """"John 3:16", or "Psalms 23" for a whole chapter."""
    if verse is None:
        return f"{book_name} {chapter}"
    return f"{book_name} {chapter}:{verse}"
