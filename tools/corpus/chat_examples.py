"""Chat-formatted training examples, encoded with the DeepSeek-V4 chat encoding.

Two kinds, so the default model's chat endpoint does something recognisable:
- REFERENCE: the user asks for a verse by reference ("What does John 3:16 say?",
  "Recite Jn 3:16."), the assistant answers with the verse text.
- CONTINUATION: the user gives the start of a verse, the assistant answers with the rest.

Each example is one single-turn conversation encoded by `common.chat.encoding.encode_messages`
with thinking off, so it reads `BOS <｜User｜>question<｜Assistant｜></think>answer EOS`.
`answer_start`/`answer_end` delimit the assistant's answer in `text`, EOS included (training
the model to stop), so a trainer can restrict the loss to it.

Determinism: every choice for a verse comes from `random.Random(f"{seed}/{kind}/{reference}")`
(string seeds are hashed with SHA-512 by `random`, stable across runs and machines), so an
example does not depend on which other verses are in the list. `ChatExampleConfig.variant` > 0
salts those seeds: the oversampled copies of well-known verses (`tools.corpus.dataset`) draw
other questions and other split points than the base examples instead of repeating them.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from dataclasses import dataclass

from moemesh.common.chat import tokens as chat_tokens
from moemesh.common.chat.encoding import encode_messages
from moemesh.tools.corpus.books import book_by_name
from moemesh.tools.corpus.kjv import Verse
from moemesh.tools.corpus.references import format_reference

REFERENCE_QUESTIONS: tuple[str, ...] = (
    "What does {ref} say?",
    "Recite {ref}.",
    "Quote {ref}.",
    "What is {ref}?",
    "{ref}",
    "Please recite {ref} from the King James Bible.",
    "What is written in {ref}?",
    "Read {ref} to me.",
)

CONTINUATION_PROMPTS: tuple[str, ...] = (
    "Continue this verse: {start}",
    "Finish the verse: {start}",
    "{start}",
    "Complete the verse that begins \"{start}\"",
    "How does this verse go on? {start}",
)


class ExampleKind(enum.Enum):
    REFERENCE = "reference"
    CONTINUATION = "continuation"


@dataclass(frozen=True)
class ChatExampleConfig:
    seed: int = 1611
    reference_examples_per_verse: int = 1
    continuation_examples_per_verse: int = 1
    abbreviation_probability: float = 0.3  # "Jn 3:16" instead of "John 3:16" in the question
    min_prompt_words: int = 3  # continuation: words given to the user at least
    min_answer_words: int = 2  # continuation: words left for the assistant at least
    variant: int = 0  # 0: the base examples; n > 0: a differently seeded set (oversampling)


@dataclass(frozen=True)
class ChatExample:
    text: str  # the whole encoded conversation, BOS .. EOS
    answer_start: int  # character offset of the assistant's answer in `text`
    answer_end: int  # end of the answer, after its EOS
    kind: ExampleKind
    reference: str  # the verse, canonical: "John 3:16"

    @property
    def answer(self) -> str:
        return self.text[self.answer_start : self.answer_end]


def encode_example(question: str, answer: str, kind: ExampleKind, reference: str) -> ChatExample:
    """Encode one user/assistant exchange and locate the answer in it."""
    user = {"role": "user", "content": question}
    prompt = encode_messages([user], thinking=False, add_bos=True)
    text = encode_messages([user, {"role": "assistant", "content": answer}], thinking=False, add_bos=True)
    expected_tail = answer + chat_tokens.EOS
    # The encoding renders an assistant turn after the generation prompt; if that ever
    # changes, the span below would be wrong, so check rather than assume.
    if not text.startswith(prompt) or text[len(prompt) :] != expected_tail:
        raise RuntimeError(f"chat encoding no longer renders prompt + answer + EOS: {text!r}")
    return ChatExample(text, len(prompt), len(text), kind, reference)


def _rng(config: ChatExampleConfig, kind: ExampleKind, verse: Verse) -> random.Random:
    salt = "" if config.variant == 0 else f"{config.variant}/"
    return random.Random(f"{config.seed}/{kind.value}/{salt}{verse.reference}")


def _display_reference(verse: Verse, rng: random.Random, config: ChatExampleConfig) -> str:
    book = book_by_name(verse.book)
    use_short = rng.random() < config.abbreviation_probability and book.short_name != book.name
    return format_reference(book.short_name if use_short else book.name, verse.chapter, verse.verse)


def reference_examples(verse: Verse, config: ChatExampleConfig) -> list[ChatExample]:
    """Each example of a verse phrased its own way while unused phrasings remain (the first as with one)."""
    rng = _rng(config, ExampleKind.REFERENCE, verse)
    examples, used = [], set()
    for _ in range(config.reference_examples_per_verse):
        template = rng.choice([q for q in REFERENCE_QUESTIONS if q not in used] or list(REFERENCE_QUESTIONS))
        used.add(template)
        question = template.format(ref=_display_reference(verse, rng, config))
        examples.append(encode_example(question, verse.text, ExampleKind.REFERENCE, verse.reference))
    return examples


def continuation_examples(verse: Verse, config: ChatExampleConfig) -> list[ChatExample]:
    """Split the verse at a word boundary; verses too short to split give none."""
    words = verse.text.split(" ")
    max_prompt_words = len(words) - config.min_answer_words
    if max_prompt_words < config.min_prompt_words:
        return []
    rng = _rng(config, ExampleKind.CONTINUATION, verse)
    examples = []
    for _ in range(config.continuation_examples_per_verse):
        # Give between a third and two thirds of the verse (within the minimums).
        low = max(config.min_prompt_words, len(words) // 3)
        high = max(low, min(max_prompt_words, (2 * len(words)) // 3))
        num_prompt_words = rng.randint(low, high)
        start = " ".join(words[:num_prompt_words])
        rest = " ".join(words[num_prompt_words:])
        question = rng.choice(CONTINUATION_PROMPTS).format(start=start)
        examples.append(encode_example(question, rest, ExampleKind.CONTINUATION, verse.reference))
    return examples


def build_chat_examples(verses: Iterable[Verse], config: ChatExampleConfig) -> list[ChatExample]:
    """All examples for `verses`, in verse order (reference ones first for each verse)."""
    examples: list[ChatExample] = []
    for verse in verses:
        examples.extend(reference_examples(verse, config))
        examples.extend(continuation_examples(verse, config))
    return examples
