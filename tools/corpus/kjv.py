"""Load the King James Bible from Debian's `bible-kjv` package.

`bible -f "Gen1:1-Rev22:21"` prints one verse per line as `<abbrev><chapter>:<verse> <text>`
(e.g. `1Cor13:4 Charity suffereth long, ...`); the abbreviations are the program's own
(`book_by_bible_abbrev`). Long verses may be wrapped by the program when a line width is in
force, so a line that does not start with a reference continues the previous verse.

The result is checked hard, because everything downstream (splits, dataset, the default
model) assumes the full text: 31,102 verses, 66 books in canonical order, 1,189 chapters,
each chapter's verses numbered 1..n without gaps. Same package version -> same verses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from moemesh.tools.corpus.books import BOOKS, NUM_CHAPTERS, NUM_VERSES, book_by_bible_abbrev
from moemesh.tools.corpus.references import Reference, format_reference, make_reference

log = structlog.get_logger(__name__)

BIBLE_PROGRAM = "bible"
FULL_RANGE = "Gen1:1-Rev22:21"
INSTALL_HINT = (
    "the `bible` program from Debian's bible-kjv package is needed to build the KJV corpus; "
    "install it with `sudo apt-get install -y bible-kjv` (Debian/Ubuntu)"
)

_VERSE_LINE = re.compile(r"^(?P<abbrev>[1-3]?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


class CorpusError(RuntimeError):
    """The Bible text is missing or is not the complete KJV."""


@dataclass(frozen=True)
class Verse:
    book: str  # canonical name, e.g. "1 Corinthians"
    chapter: int
    verse: int
    text: str  # one line, single-spaced, no trailing whitespace

    @property
    def reference(self) -> str:
        return format_reference(self.book, self.chapter, self.verse)

    @property
    def chapter_key(self) -> tuple[str, int]:
        return (self.book, self.chapter)


def bible_program_available() -> bool:
    return shutil.which(BIBLE_PROGRAM) is not None


def read_bible_output(verse_range: str = FULL_RANGE) -> str:
    """Run `bible -f RANGE` and return its stdout. Raises CorpusError (with the install
    hint) when the program is missing or fails."""
    program = shutil.which(BIBLE_PROGRAM)
    if program is None:
        raise CorpusError(INSTALL_HINT)
    # A huge line width keeps every verse on one line; the parser copes with wrapping anyway.
    env = {**os.environ, "COLUMNS": "100000", "LC_ALL": "C.UTF-8"}
    completed = subprocess.run(
        [program, "-f", verse_range], capture_output=True, env=env, check=False, timeout=120
    )
    if completed.returncode != 0:
        raise CorpusError(
            f"`bible -f {verse_range}` failed with status {completed.returncode}: "
            f"{completed.stderr.decode(errors='replace').strip()} ({INSTALL_HINT})"
        )
    return completed.stdout.decode("utf-8")


def parse_bible_output(output: str) -> list[Verse]:
    """Parse `bible -f` output into verses (no completeness check; see `check_complete`)."""
    verses: list[Verse] = []
    pending: tuple[str, int, int, list[str]] | None = None

    def flush() -> None:
        if pending is not None:
            book, chapter, verse, parts = pending
            verses.append(Verse(book, chapter, verse, " ".join(" ".join(parts).split())))

    for line in output.splitlines():
        if not line.strip():
            continue
        match = _VERSE_LINE.match(line)
        book = book_by_bible_abbrev(match["abbrev"]) if match else None
        if match is None or book is None:
            if pending is None:
                raise CorpusError(f"unexpected line before the first verse: {line[:80]!r}")
            pending[3].append(line.strip())
            continue
        flush()
        pending = (book.name, int(match["chapter"]), int(match["verse"]), [match["text"]])
    flush()
    return verses


def check_complete(verses: list[Verse]) -> None:
    """Raise CorpusError unless `verses` is the whole KJV in canonical order."""
    if len(verses) != NUM_VERSES:
        raise CorpusError(f"expected {NUM_VERSES} verses, parsed {len(verses)}")
    expected_order = {book.name: book.index for book in BOOKS}
    previous: Verse | None = None
    chapter_keys: set[tuple[str, int]] = set()
    for verse in verses:
        if not verse.text:
            raise CorpusError(f"{verse.reference} has no text")
        if previous is None or verse.chapter_key != previous.chapter_key:
            if verse.verse != 1:
                raise CorpusError(f"chapter starts at {verse.reference}, not verse 1")
            if previous is not None and (
                expected_order[verse.book],
                verse.chapter,
            ) <= (expected_order[previous.book], previous.chapter):
                raise CorpusError(f"{verse.reference} follows {previous.reference}: not canonical order")
            chapter_keys.add(verse.chapter_key)
        elif verse.verse != previous.verse + 1:
            raise CorpusError(f"{verse.reference} follows {previous.reference}: verse gap")
        previous = verse
    if len(chapter_keys) != NUM_CHAPTERS:
        raise CorpusError(f"expected {NUM_CHAPTERS} chapters, found {len(chapter_keys)}")
    for book in BOOKS:
        found = sum(1 for key in chapter_keys if key[0] == book.name)
        if found != book.num_chapters:
            raise CorpusError(f"{book.name}: expected {book.num_chapters} chapters, found {found}")


def load_verses() -> list[Verse]:
    """All 31,102 verses, in canonical order, checked complete."""
    verses = parse_bible_output(read_bible_output())
    check_complete(verses)
    log.info("corpus.kjv_loaded", num_verses=len(verses))
    return verses


def verse_index(verses: Iterable[Verse]) -> dict[Reference, Verse]:
    """Reference -> verse, for looking up parsed references."""
    return {make_reference(v.book, v.chapter, v.verse): v for v in verses}


def group_by_chapter(verses: Iterable[Verse]) -> dict[tuple[str, int], list[Verse]]:
    """(book, chapter) -> its verses, in canonical order (dicts keep insertion order)."""
    chapters: dict[tuple[str, int], list[Verse]] = {}
    for verse in verses:
        chapters.setdefault(verse.chapter_key, []).append(verse)
    return chapters
