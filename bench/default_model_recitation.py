"""Recitation of the whole book by the default model, measured through a running `moemesh serve`.

The sample: `per_book` verses from each of the 66 books (a seeded draw per book, `random.Random(
f"{seed}/{book}")`, so a book's verses do not depend on the other books), never from the held-out
chapters (`tools.corpus.splits.validation_chapters`, which the model is not trained on). With the
defaults (8 per book, seed 1611) that is a fixed sample of 528 verses.

Two questions per verse, both at temperature 0:
- recitation: "Recite <reference>." through /v1/chat/completions; exact when the answer, stripped,
  equals the KJV text;
- continuation: "<reference> <first third of the words>" through /v1/completions (the running-text
  form of training), stopped at the end of the line; exact when the rest of the verse comes back.
Figures: the exact fractions overall and per book (`by_book`), every answer kept.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from dataclasses import dataclass

QUESTION = "Recite {ref}."
DEFAULT_PER_BOOK = 8
MAX_TOKENS = 200  # the longest verse (Esther 8:9) is about 110 tokens


@dataclass(frozen=True)
class SampledVerse:
    book: str
    reference: str
    text: str

    @property
    def continuation_split(self) -> tuple[str, str]:
        """(prompt words, expected rest): the first third of the words (at least one) are given."""
        words = self.text.split(" ")
        given = max(1, len(words) // 3)
        return " ".join(words[:given]), " ".join(words[given:])


def book_sample(verses, per_book: int = DEFAULT_PER_BOOK, seed: int = 1611, held_out=None) -> list[SampledVerse]:
    """`per_book` verses of every book in canonical order (all of a book's verses when it has fewer),
    none from the `held_out` chapters ((book, chapter) keys; default: the training split's)."""
    if held_out is None:
        from moemesh.tools.corpus.splits import SplitConfig, validation_chapters

        held_out = validation_chapters(SplitConfig())
    held_out = set(held_out)
    by_book: dict[str, list] = {}
    for verse in verses:
        if verse.chapter_key not in held_out:
            by_book.setdefault(verse.book, []).append(verse)
    sample = []
    for book, candidates in by_book.items():
        chosen = random.Random(f"{seed}/{book}").sample(candidates, min(per_book, len(candidates)))
        chosen.sort(key=lambda v: (v.chapter, v.verse))
        sample += [SampledVerse(book, v.reference, v.text) for v in chosen]
    return sample


def _post(base_url: str, path: str, body: dict) -> dict:
    import httpx

    reply = httpx.post(f"{base_url}{path}", json=body, timeout=900)
    reply.raise_for_status()
    return reply.json()


def ask_recitation(base_url: str, model: str, verse: SampledVerse) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": QUESTION.format(ref=verse.reference)}]}
    answer = _post(base_url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    return {"book": verse.book, "reference": verse.reference, "expected": verse.text, "answer": answer,
            "exact": answer.strip() == verse.text}


def ask_continuation(base_url: str, model: str, verse: SampledVerse) -> dict:
    given, rest = verse.continuation_split
    prompt = f"{verse.reference} {given}"
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stop": ["\n"]}
    text = _post(base_url, "/v1/completions", body)["choices"][0]["text"]
    return {"book": verse.book, "reference": verse.reference, "prompt": prompt, "expected": rest,
            "continuation": text, "exact": text.split("\n")[0].strip() == rest}


def per_book(rows: list[dict]) -> dict[str, dict]:
    """{book: {"num": n, "exact": k, "fraction_exact": k / n}} in the order the books first appear."""
    out: dict[str, dict] = {}
    for row in rows:
        entry = out.setdefault(row["book"], {"num": 0, "exact": 0})
        entry["num"] += 1
        entry["exact"] += int(row["exact"])
    for entry in out.values():
        entry["fraction_exact"] = entry["exact"] / entry["num"]
    return out


def run_book_sample(base_url: str, model: str, sample: list[SampledVerse], concurrency: int,
                    continuation: bool = True) -> dict:
    """Both questions for every sampled verse, asked of the served `model`; figures overall and per book."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        recited = list(pool.map(lambda v: ask_recitation(base_url, model, v), sample))
        recitation_s = time.monotonic() - started
        continued = list(pool.map(lambda v: ask_continuation(base_url, model, v), sample)) if continuation else []
    seconds = time.monotonic() - started

    def fraction(rows) -> float | None:
        return sum(r["exact"] for r in rows) / len(rows) if rows else None

    recitation_books, continuation_books = per_book(recited), per_book(continued)
    by_book = {book: {"recitation": entry, "continuation": continuation_books.get(book)}
               for book, entry in recitation_books.items()}
    return {"question": QUESTION, "num_verses": len(sample), "num_books": len(by_book),
            "recitation_fraction_exact": fraction(recited), "continuation_fraction_exact": fraction(continued),
            "books_all_recited": sum(1 for e in recitation_books.values() if e["exact"] == e["num"]),
            "books_none_recited": sum(1 for e in recitation_books.values() if e["exact"] == 0),
            "seconds": round(seconds, 1), "recitation_seconds": round(recitation_s, 1),
            "by_book": by_book, "recitation_answers": recited, "continuation_answers": continued}
