"""The 66 books of the King James Bible: canonical names, chapter counts and aliases.

Invariants: `BOOKS` is in canonical order (Genesis .. Revelation), `index` is the position
in that order, and the chapter counts sum to 1,189. `bible_abbrev` is the spelling the
Debian `bible` program (package `bible-kjv`) prints with `-f`; it is used only to parse that
output. Aliases are lower-case with no spaces or dots, so lookups normalise the query the
same way (see `normalize_book_key`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Book:
    index: int
    name: str  # canonical, as printed in references: "1 Corinthians"
    bible_abbrev: str  # the `bible -f` prefix: "1Cor"
    num_chapters: int
    aliases: tuple[str, ...]  # normalised keys besides the canonical name
    short_name: str  # a common abbreviation for display: "Jn", "1 Cor", "Psalm"


# (name, bible -f abbreviation, chapters, extra aliases). Numbered books get their
# "1", "i", "first" forms generated below, so only the stem aliases are listed here.
_BOOK_ROWS: tuple[tuple[str, str, int, tuple[str, ...]], ...] = (
    ("Genesis", "Ge", 50, ("gen", "ge", "gn")),
    ("Exodus", "Exo", 40, ("exo", "ex", "exod")),
    ("Leviticus", "Lev", 27, ("lev", "le", "lv")),
    ("Numbers", "Num", 36, ("num", "nu", "nm", "numb")),
    ("Deuteronomy", "Deu", 34, ("deut", "deu", "dt", "de")),
    ("Joshua", "Josh", 24, ("josh", "jos", "jsh")),
    ("Judges", "Jdgs", 21, ("judg", "jdgs", "jdg", "jg")),
    ("Ruth", "Ruth", 4, ("rth", "ru")),
    ("1 Samuel", "1Sm", 31, ("samuel", "sam", "sa", "sm")),
    ("2 Samuel", "2Sm", 24, ("samuel", "sam", "sa", "sm")),
    ("1 Kings", "1Ki", 22, ("kings", "kgs", "ki", "kin")),
    ("2 Kings", "2Ki", 25, ("kings", "kgs", "ki", "kin")),
    ("1 Chronicles", "1Chr", 29, ("chronicles", "chron", "chr", "ch")),
    ("2 Chronicles", "2Chr", 36, ("chronicles", "chron", "chr", "ch")),
    ("Ezra", "Ezra", 10, ("ezr",)),
    ("Nehemiah", "Neh", 13, ("neh", "ne")),
    ("Esther", "Est", 10, ("est", "esth", "es")),
    ("Job", "Job", 42, ("jb",)),
    ("Psalms", "Psa", 150, ("psalm", "ps", "psa", "pss", "psm")),
    ("Proverbs", "Prv", 31, ("prov", "prv", "pro", "pr")),
    ("Ecclesiastes", "Eccl", 12, ("eccl", "ecc", "eccles", "ec", "qoh")),
    ("Song of Solomon", "SSol", 8, ("song", "songofsongs", "sos", "ssol", "canticles", "song of songs")),
    ("Isaiah", "Isa", 66, ("isa", "is")),
    ("Jeremiah", "Jer", 52, ("jer", "je", "jr")),
    ("Lamentations", "Lam", 5, ("lam", "la")),
    ("Ezekiel", "Eze", 48, ("ezek", "eze", "ezk")),
    ("Daniel", "Dan", 12, ("dan", "da", "dn")),
    ("Hosea", "Hos", 14, ("hos", "ho")),
    ("Joel", "Joel", 3, ("jl", "joe")),
    ("Amos", "Amos", 9, ("am",)),
    ("Obadiah", "Obad", 1, ("obad", "ob")),
    ("Jonah", "Jonah", 4, ("jon", "jnh")),
    ("Micah", "Mic", 7, ("mic", "mi")),
    ("Nahum", "Nahum", 3, ("nah", "na")),
    ("Habakkuk", "Hab", 3, ("hab", "hb")),
    ("Zephaniah", "Zep", 3, ("zeph", "zep", "zp")),
    ("Haggai", "Hag", 2, ("hag", "hg")),
    ("Zechariah", "Zec", 14, ("zech", "zec", "zc")),
    ("Malachi", "Mal", 4, ("mal", "ml")),
    ("Matthew", "Mat", 28, ("matt", "mat", "mt")),
    ("Mark", "Mark", 16, ("mrk", "mk", "mr")),
    ("Luke", "Luke", 24, ("luk", "lk")),
    ("John", "John", 21, ("jn", "jhn", "joh")),
    ("Acts", "Acts", 28, ("act", "ac")),
    ("Romans", "Rom", 16, ("rom", "ro", "rm")),
    ("1 Corinthians", "1Cor", 16, ("corinthians", "cor", "co")),
    ("2 Corinthians", "2Cor", 13, ("corinthians", "cor", "co")),
    ("Galatians", "Gal", 6, ("gal", "ga")),
    ("Ephesians", "Eph", 6, ("eph", "ephes")),
    ("Philippians", "Phi", 4, ("phil", "php", "pp")),
    ("Colossians", "Col", 4, ("col",)),
    ("1 Thessalonians", "1Th", 5, ("thessalonians", "thess", "thes", "th")),
    ("2 Thessalonians", "2Th", 3, ("thessalonians", "thess", "thes", "th")),
    ("1 Timothy", "1Tim", 6, ("timothy", "tim", "ti")),
    ("2 Timothy", "2Tim", 4, ("timothy", "tim", "ti")),
    ("Titus", "Titus", 3, ("tit",)),
    ("Philemon", "Phmn", 1, ("philem", "phlm", "phm", "phmn")),
    ("Hebrews", "Heb", 13, ("heb",)),
    ("James", "Jas", 5, ("jas", "jm")),
    ("1 Peter", "1Pet", 5, ("peter", "pet", "pe", "pt")),
    ("2 Peter", "2Pet", 3, ("peter", "pet", "pe", "pt")),
    ("1 John", "1Jn", 5, ("john", "jn", "jhn", "joh")),
    ("2 John", "2Jn", 1, ("john", "jn", "jhn", "joh")),
    ("3 John", "3Jn", 1, ("john", "jn", "jhn", "joh")),
    ("Jude", "Jude", 1, ("jud", "jd")),
    ("Revelation", "Rev", 22, ("rev", "re", "revelations", "apocalypse", "rv")),
)

_ORDINAL_PREFIXES: dict[str, tuple[str, ...]] = {
    "1": ("1", "i", "first", "1st"),
    "2": ("2", "ii", "second", "2nd"),
    "3": ("3", "iii", "third", "3rd"),
}

# Books whose first listed alias is not the usual written abbreviation.
_SHORT_NAME_OVERRIDES: dict[str, str] = {
    "Ruth": "Ruth", "Ezra": "Ezra", "Job": "Job", "Joel": "Joel", "Amos": "Amos",
    "Mark": "Mk", "Luke": "Lk", "Acts": "Acts", "Titus": "Titus", "Jude": "Jude",
}

_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def normalize_book_key(text: str) -> str:
    """Lower-case and drop everything but letters and digits: "1 Cor." -> "1cor"."""
    return _NON_ALNUM.sub("", text.lower())


def _build_books() -> tuple[Book, ...]:
    books = []
    for index, (name, bible_abbrev, num_chapters, stems) in enumerate(_BOOK_ROWS):
        number, _, stem_name = name.partition(" ")
        if name in _SHORT_NAME_OVERRIDES:
            short_name = _SHORT_NAME_OVERRIDES[name]
        elif number in _ORDINAL_PREFIXES:
            short_name = f"{number} {stems[1].title()}"  # stems[0] is the full stem
        else:
            short_name = stems[0].title()
        if number in _ORDINAL_PREFIXES:
            all_stems = (stem_name.lower(),) + stems
            # Roman numerals only with stems of 3+ letters: "i" + "sa" would read as Isaiah.
            aliases = tuple(
                prefix + stem
                for prefix in _ORDINAL_PREFIXES[number]
                for stem in all_stems
                if not (prefix.startswith("i") and len(stem) < 3)
            )
        else:
            aliases = stems
        aliases = aliases + (bible_abbrev.lower(),)
        normalised = tuple(dict.fromkeys(normalize_book_key(alias) for alias in aliases))
        books.append(Book(index, name, bible_abbrev, num_chapters, normalised, short_name))
    return tuple(books)


BOOKS: tuple[Book, ...] = _build_books()
NUM_BOOKS = 66
NUM_CHAPTERS = 1189
NUM_VERSES = 31102


def _build_lookup() -> dict[str, Book]:
    """Alias key -> book. The canonical name wins over any alias of another book; of two
    books sharing an alias, the earlier one in canonical order keeps it ("jn" is John,
    not 1 John, whose aliases all carry a number)."""
    lookup: dict[str, Book] = {}
    for book in BOOKS:
        lookup[normalize_book_key(book.name)] = book
    for book in BOOKS:
        for alias in book.aliases:
            lookup.setdefault(alias, book)
    return lookup


_LOOKUP: dict[str, Book] = _build_lookup()
_BY_BIBLE_ABBREV: dict[str, Book] = {book.bible_abbrev: book for book in BOOKS}


def find_book(text: str) -> Book | None:
    """The book a name or abbreviation denotes ("Jn", "1 Cor", "Song of Songs"), or None."""
    return _LOOKUP.get(normalize_book_key(text))


def book_by_bible_abbrev(abbrev: str) -> Book | None:
    """The book for a `bible -f` prefix such as "1Cor", exactly as the program prints it."""
    return _BY_BIBLE_ABBREV.get(abbrev)


def book_by_name(name: str) -> Book:
    """The book with this canonical name; KeyError if there is none."""
    book = find_book(name)
    if book is None or book.name != name:
        raise KeyError(name)
    return book
