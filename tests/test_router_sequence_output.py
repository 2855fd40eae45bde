"""Stop strings on streamed text: the same cut however the text is split, never a partial
stop string released."""

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.services.router.sequence_output import StopStringMatcher


def run(text, stops, pieces):
    matcher = StopStringMatcher(stops)
    released, start = [], 0
    for size in pieces:
        released.append(matcher.feed(text[start : start + size]))
        start += size
    released.append(matcher.feed(text[start:]))
    released.append(matcher.finish())
    return released, matcher.matched


def test_cut_at_first_stop_string():
    released, matched = run("abc STOP def END", ("END", "STOP"), [1] * 16)
    assert "".join(released) == "abc " and matched == "STOP"


def test_partial_stop_string_is_held_then_released():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("ab ST") == "ab "
    assert matcher.feed("AR") == "STAR"
    assert matcher.feed("ST") == ""
    assert matcher.finish() == "ST" and matcher.matched is None


@settings(max_examples=1000, deadline=None)
@given(
    st.text(alphabet="abS TOP", max_size=40),
    st.lists(st.text(alphabet="abSTOP", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), max_size=20),
)
def test_any_split_gives_the_whole_text_cut(text, stops, pieces):
    released, matched = run(text, tuple(stops), pieces)
    cuts = [(text.find(s), s) for s in stops if s in text]
    expected = text[: min(cuts)[0]] if cuts else text
    assert "".join(released) == expected
    assert (matched is not None) == bool(cuts)
    for piece_end in range(1, len(released)):
        shown = "".join(released[:piece_end])
        assert not any(s in shown for s in stops)
