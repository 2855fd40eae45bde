"""Incremental detokenization: never half a character, equal to a full decode at the end."""

from hypothesis import given, settings
from hypothesis import strategies as st
from router_support import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moemesh.common.chat import tokens as tk
from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

TOKENIZER = tiny_tokenizer()
TOKEN_BYTES = TokenBytes(TOKENIZER)
VOCAB_SIZE = TOKENIZER.get_vocab_size()


def stream(ids, *, skip_special_tokens=False, chunk=1):
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip_special_tokens, token_bytes=TOKEN_BYTES)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces


def test_tokenizer_is_byte_level_and_splits_characters():
    assert TOKEN_BYTES.is_byte_level
    ids = TOKENIZER.encode("ñ 😀 日本").ids
    # at least one token holds only part of a multi-byte character
    assert any(_is_partial(TOKEN_BYTES(t)) for t in ids)


def _is_partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_multibyte_characters_are_never_split():
    text = "Zoë 😀🎉 日本語テキスト ok"
    ids = TOKENIZER.encode(text).ids
    pieces = stream(ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # one token at a time, some steps release nothing because a character is incomplete
    assert "" in pieces[:-1]


def test_special_tokens_kept_or_skipped_like_full_decode():
    text = f"{tk.BOS}hi{tk.USER}héllo{tk.ASSISTANT}</think>ok{tk.EOS}"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert TOKENIZER.token_to_id(tk.EOS) in ids
    for skip in (False, True):
        assert "".join(stream(ids, skip_special_tokens=skip)) == TOKENIZER.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(ids)) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), max_size=40), st.integers(1, 4), st.booleans())
def test_random_ids_match_full_decode(ids, chunk, skip):
    """Random ids include stray continuation bytes: replacement must match tokenizers."""
    pieces = stream(ids, skip_special_tokens=skip, chunk=chunk)
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=skip)


def test_windowed_fallback_for_non_byte_level_decoder():
    vocab = {"[UNK]": 0, "▁hello": 1, "▁wor": 2, "ld": 3, "▁ç": 4, "a": 5}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    ids = [1, 2, 3, 4, 5]
    text = "".join(detok.add([t]) for t in ids) + detok.finish()
    assert text == tokenizer.decode(ids)
