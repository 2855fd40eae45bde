"""The whole-book recitation sample of `moemesh bench default-model` (bench.default_model_recitation):
fixed, every book, no held-out chapter; per-book figures; the questions as the server sees them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from moemesh.bench.default_model_recitation import SampledVerse, book_sample, per_book, run_book_sample
from moemesh.tools.corpus.kjv import Verse


def _verses():
    out = []
    for book, chapters in (("Genesis", 3), ("Obadiah", 1), ("John", 2)):
        for chapter in range(1, chapters + 1):
            out += [Verse(book, chapter, v, f"{book} words {chapter} {v} and more words here") for v in range(1, 6)]
    return out


def test_book_sample_is_fixed_per_book_and_skips_held_out_chapters():
    verses = _verses()
    sample = book_sample(verses, per_book=3, seed=7, held_out=[("Genesis", 2)])
    assert [v.book for v in sample] == ["Genesis"] * 3 + ["Obadiah"] * 3 + ["John"] * 3
    assert not any(v.reference.startswith("Genesis 2:") for v in sample)
    assert sample == book_sample(verses, per_book=3, seed=7, held_out=[("Genesis", 2)])
    # a book's draw does not depend on the other books
    alone = book_sample([v for v in verses if v.book == "John"], per_book=3, seed=7, held_out=[])
    assert alone == [v for v in sample if v.book == "John"]
    assert len(book_sample(verses, per_book=50, seed=7, held_out=[])) == len(verses)  # small books: all verses


def test_continuation_split_leaves_the_rest():
    verse = SampledVerse("John", "John 11:35", "Jesus wept.")
    assert verse.continuation_split == ("Jesus", "wept.")
    given, rest = SampledVerse("G", "G 1:1", "a b c d e f g").continuation_split
    assert (given, rest) == ("a b", "c d e f g")


def test_per_book_fractions():
    rows = [{"book": "A", "exact": True}, {"book": "A", "exact": False}, {"book": "B", "exact": True}]
    assert per_book(rows) == {"A": {"num": 2, "exact": 1, "fraction_exact": 0.5},
                              "B": {"num": 1, "exact": 1, "fraction_exact": 1.0}}


class _FakeServer(BaseHTTPRequestHandler):
    """Answers every chat question with the text of Genesis 1:1 and every completion with its rest."""

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "served-name"
        if self.path == "/v1/chat/completions":
            assert body["temperature"] == 0 and body["messages"][0]["content"].startswith("Recite ")
            reply = {"choices": [{"message": {"content": " In the beginning God created the heaven and the earth."}}]}
        else:
            assert body["stop"] == ["\n"] and body["prompt"] == "Genesis 1:1 In the beginning"
            reply = {"choices": [{"text": " God created the heaven and the earth."}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_run_book_sample_against_a_server():
    server = HTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sample = [SampledVerse("Genesis", "Genesis 1:1", "In the beginning God created the heaven and the earth."),
                  SampledVerse("Exodus", "Exodus 1:1", "Now these are the names of the children of Israel")]
        figures = run_book_sample(f"http://127.0.0.1:{server.server_address[1]}", "served-name", sample[:1], concurrency=2)
        assert figures["recitation_fraction_exact"] == 1.0 and figures["continuation_fraction_exact"] == 1.0
        figures = run_book_sample(f"http://127.0.0.1:{server.server_address[1]}", "served-name", sample, concurrency=2,
                                  continuation=False)
        assert figures["recitation_fraction_exact"] == 0.5 and figures["continuation_fraction_exact"] is None
        assert figures["by_book"]["Exodus"]["recitation"]["exact"] == 0 and figures["books_none_recited"] == 1
    finally:
        server.shutdown()
