"""Chat-formatted examples: encoding markers in order, answer span, determinism."""

from moemesh.common.chat import tokens as tk
from moemesh.tools.corpus.chat_examples import (
    REFERENCE_QUESTIONS,
    ChatExampleConfig,
    ExampleKind,
    build_chat_examples,
    continuation_examples,
    reference_examples,
)
from moemesh.tools.corpus.kjv import Verse

JOHN_3_16 = Verse(
    "John", 3, 16,
    "For God so loved the world, that he gave his only begotten Son, that whosoever believeth in him "
    "should not perish, but have everlasting life.",
)
JOHN_11_35 = Verse("John", 11, 35, "Jesus wept.")
GENESIS_1_1 = Verse("Genesis", 1, 1, "In the beginning God created the heaven and the earth.")


def _marker_positions(text, markers):
    return [text.index(marker) for marker in markers]


def test_examples_carry_the_encoding_markers_in_order_and_end_with_eos():
    for example in build_chat_examples([GENESIS_1_1, JOHN_3_16], ChatExampleConfig()):
        positions = _marker_positions(example.text, [tk.BOS, tk.USER, tk.ASSISTANT, tk.THINK_END, tk.EOS])
        assert positions == sorted(positions) and positions[0] == 0
        assert example.text.endswith(tk.EOS)
        assert tk.THINK_START not in example.text  # thinking off
        # The answer comes right after `<｜Assistant｜></think>` and runs to the end.
        assert example.text[: example.answer_start].endswith(tk.ASSISTANT + tk.THINK_END)
        assert example.answer_end == len(example.text)
        assert example.answer.endswith(tk.EOS)


def test_reference_example_answers_with_the_verse_and_names_the_verse():
    (example,) = reference_examples(JOHN_3_16, ChatExampleConfig())
    assert example.kind is ExampleKind.REFERENCE
    assert example.answer == JOHN_3_16.text + tk.EOS
    question = example.text[: example.answer_start]
    assert "John 3:16" in question or "Jn 3:16" in question
    assert example.reference == "John 3:16"


def test_abbreviations_appear_when_asked_for():
    always = ChatExampleConfig(abbreviation_probability=1.0)
    never = ChatExampleConfig(abbreviation_probability=0.0)
    assert "Jn 3:16" in reference_examples(JOHN_3_16, always)[0].text
    assert "John 3:16" in reference_examples(JOHN_3_16, never)[0].text


def test_continuation_example_splits_the_verse_at_a_word_boundary():
    (example,) = continuation_examples(JOHN_3_16, ChatExampleConfig())
    assert example.kind is ExampleKind.CONTINUATION
    rest = example.answer.removesuffix(tk.EOS)
    assert JOHN_3_16.text.endswith(" " + rest)
    start = JOHN_3_16.text[: -len(rest) - 1]
    assert start in example.text[: example.answer_start]
    assert 3 <= len(start.split()) and 2 <= len(rest.split())


def test_verses_too_short_to_continue_give_only_reference_examples():
    examples = build_chat_examples([JOHN_11_35], ChatExampleConfig())
    assert [e.kind for e in examples] == [ExampleKind.REFERENCE]


def test_examples_are_deterministic_and_independent_of_the_other_verses():
    config = ChatExampleConfig()
    alone = build_chat_examples([JOHN_3_16], config)
    together = build_chat_examples([GENESIS_1_1, JOHN_3_16], config)
    assert alone == together[-len(alone):]
    assert alone == build_chat_examples([JOHN_3_16], config)
    other_seed = ChatExampleConfig(seed=config.seed + 1)
    phrasings = {build_chat_examples([GENESIS_1_1], ChatExampleConfig(seed=s))[0].text for s in range(20)}
    assert len(phrasings) > 1, "the seed must vary the phrasing"
    assert build_chat_examples([JOHN_3_16], other_seed)[0].answer == alone[0].answer


def test_counts_follow_the_config():
    config = ChatExampleConfig(reference_examples_per_verse=3, continuation_examples_per_verse=2)
    kinds = [e.kind for e in build_chat_examples([JOHN_3_16], config)]
    assert kinds.count(ExampleKind.REFERENCE) == 3 and kinds.count(ExampleKind.CONTINUATION) == 2


def test_reference_examples_of_a_verse_are_phrased_apart_and_the_first_stays_the_same():
    one = build_chat_examples([JOHN_3_16], ChatExampleConfig(reference_examples_per_verse=1))
    four = build_chat_examples([JOHN_3_16], ChatExampleConfig(reference_examples_per_verse=4))
    references = [e for e in four if e.kind is ExampleKind.REFERENCE]
    assert references[0].text == one[0].text
    questions = [e.text[: e.answer_start] for e in references]
    templates = [next(q for q in REFERENCE_QUESTIONS if _renders(q, text)) for text in questions]
    assert len(set(templates)) == 4
    assert all(e.answer == JOHN_3_16.text + tk.EOS for e in references)


def _renders(template: str, prompt: str) -> bool:
    """Whether the chat prompt is `template` with John 3:16's reference, full or abbreviated."""
    user = prompt.split("<｜User｜>")[1].split("<｜Assistant｜>")[0]
    return user in {template.format(ref=ref) for ref in ("John 3:16", "Jn 3:16")}
