"""KJV loading: parsing `bible -f` output, completeness checks, and (when the `bible`
program of Debian's bible-kjv package is installed) the real text."""

import dataclasses

import pytest

from moemesh.tools.corpus.kjv import (
    INSTALL_HINT,
    CorpusError,
    Verse,
    bible_program_available,
    check_complete,
    load_verses,
    parse_bible_output,
    read_bible_output,
    verse_index,
)
from moemesh.tools.corpus.references import parse_reference

needs_bible = pytest.mark.skipif(not bible_program_available(), reason="`bible` (apt-get install bible-kjv) absent")

SAMPLE = """Ge1:1 In the beginning God created the heaven and the earth.
Ge1:2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

1Cor13:4 Charity suffereth long, and is kind;  charity envieth not.
SSol1:1 The song of songs, which is Solomon's.
"""


def test_parse_sample_output_joins_wrapped_lines_and_maps_abbreviations():
    verses = parse_bible_output(SAMPLE)
    assert [v.reference for v in verses] == ["Genesis 1:1", "Genesis 1:2", "1 Corinthians 13:4", "Song of Solomon 1:1"]
    assert verses[1].text.endswith("darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.")
    assert verses[2].text == "Charity suffereth long, and is kind; charity envieth not."


def test_parse_rejects_text_before_the_first_verse():
    with pytest.raises(CorpusError):
        parse_bible_output("garbage\nGe1:1 In the beginning")


def test_check_complete_rejects_a_partial_text():
    with pytest.raises(CorpusError, match="31102"):
        check_complete(parse_bible_output(SAMPLE))


def test_missing_program_fails_with_the_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not bible_program_available()
    with pytest.raises(CorpusError) as error:
        read_bible_output()
    assert "apt-get install -y bible-kjv" in str(error.value) and INSTALL_HINT in str(error.value)


@pytest.fixture(scope="module")
def verses():
    if not bible_program_available():
        pytest.skip("`bible` (apt-get install bible-kjv) absent")
    return load_verses()


@needs_bible
def test_full_text_is_complete_and_known_verses_read_right(verses):
    assert len(verses) == 31102
    assert len({v.chapter_key for v in verses}) == 1189
    index = verse_index(verses)
    assert index[parse_reference("Jn 3:16")].text.startswith("For God so loved the world, that he gave his only begotten Son")
    assert index[parse_reference("Gen 1:1")].text == "In the beginning God created the heaven and the earth."
    assert index[parse_reference("John 11:35")].text == "Jesus wept."
    assert index[parse_reference("1 Cor 13:4")].text.startswith("Charity suffereth long")
    assert verses[-1].reference == "Revelation 22:21"
    assert all(v.text == v.text.strip() and "\n" not in v.text and "  " not in v.text for v in verses)


@needs_bible
def test_check_complete_notices_a_missing_or_reordered_verse(verses):
    with pytest.raises(CorpusError):
        check_complete(verses[:100] + verses[101:] + [dataclasses.replace(verses[-1], verse=22)])
    with pytest.raises(CorpusError):
        check_complete([verses[1], verses[0]] + verses[2:])


@needs_bible
def test_loading_is_deterministic(verses):
    assert load_verses() == verses


def test_verse_is_a_frozen_record():
    verse = Verse("John", 3, 16, "For God so loved the world")
    assert verse.reference == "John 3:16" and verse.chapter_key == ("John", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        verse.text = "x"
