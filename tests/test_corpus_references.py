"""Book table and verse-reference parsing (no Bible text needed)."""

import pytest

from moemesh.tools.corpus.books import BOOKS, NUM_BOOKS, NUM_CHAPTERS, book_by_bible_abbrev, find_book
from moemesh.tools.corpus.references import ReferenceError, format_reference, make_reference, parse_reference


def test_book_table_is_the_protestant_canon_in_order():
    assert len(BOOKS) == NUM_BOOKS == 66
    assert sum(book.num_chapters for book in BOOKS) == NUM_CHAPTERS == 1189
    assert [book.index for book in BOOKS] == list(range(66))
    assert BOOKS[0].name == "Genesis" and BOOKS[39].name == "Matthew" and BOOKS[-1].name == "Revelation"
    assert {book.name: book.num_chapters for book in BOOKS}["Psalms"] == 150


def test_every_name_short_name_and_alias_resolves_to_its_book():
    for book in BOOKS:
        assert find_book(book.name) is book
        assert find_book(book.short_name) is book
        assert book_by_bible_abbrev(book.bible_abbrev) is book
        for alias in book.aliases:
            assert find_book(alias) is book, (book.name, alias)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("John 3:16", "John 3:16"),
        ("Jn 3:16", "John 3:16"),
        ("jn 3.16", "John 3:16"),
        ("John 3 : 16", "John 3:16"),
        ("1 Cor 13:4", "1 Corinthians 13:4"),
        ("1Cor 13:4", "1 Corinthians 13:4"),
        ("I Corinthians 13:4", "1 Corinthians 13:4"),
        ("First Corinthians 13:4", "1 Corinthians 13:4"),
        ("Gen. 1:1", "Genesis 1:1"),
        ("Ps 23", "Psalms 23"),
        ("Psalm 119:105", "Psalms 119:105"),
        ("Song of Songs 2:1", "Song of Solomon 2:1"),
        ("Song of Solomon 2:1", "Song of Solomon 2:1"),
        ("Isa 53:5", "Isaiah 53:5"),
        ("Isaiah 53:5", "Isaiah 53:5"),
        ("1 Jn 1:9", "1 John 1:9"),
        ("3 John 1:4", "3 John 1:4"),
        ("Phil 4:13", "Philippians 4:13"),
        ("Philem 1:1", "Philemon 1:1"),
        ("Rev 22:21", "Revelation 22:21"),
        ("  Jude 1:25  ", "Jude 1:25"),
    ],
)
def test_parse_reference_accepts_common_spellings(text, expected):
    assert str(parse_reference(text)) == expected


@pytest.mark.parametrize("text", ["Foo 1:1", "John 22:1", "John 3:0", "hello", "", "3:16", "Genesis 0:1"])
def test_parse_reference_rejects_non_references(text):
    with pytest.raises(ReferenceError):
        parse_reference(text)


def test_whole_chapter_reference_has_no_verse_and_references_sort_in_canonical_order():
    chapter = parse_reference("Psalm 23")
    assert chapter.verse is None and chapter.chapter == 23
    refs = [parse_reference(t) for t in ["Rev 1:1", "Gen 2:1", "Gen 1:31", "Mt 5:3"]]
    assert [str(r) for r in sorted(refs)] == ["Genesis 1:31", "Genesis 2:1", "Matthew 5:3", "Revelation 1:1"]


def test_make_and_format_reference_round_trip():
    ref = make_reference("1 Corinthians", 13, 4)
    assert parse_reference(str(ref)) == ref
    assert format_reference("Psalms", 23) == "Psalms 23"
    with pytest.raises(KeyError):
        make_reference("Jn", 3, 16)  # canonical names only
