"""Incremental detokenization, one instance per generated sequence.

Byte-level BPE (DeepSeek's tokenizer, GPT-2's, ...) maps every token to raw bytes, and a
multi-byte UTF-8 character may be split across tokens. We keep the bytes of an incomplete
character back until the tokens that complete it arrive, so no text we release ever ends
in half a character. Decoding is done with Python's incremental UTF-8 decoder, which
replaces invalid sequences the same way `tokenizers` does (maximal subparts -> U+FFFD), so
the concatenation of everything released, plus `finish()`, equals
`tokenizer.decode(all_ids, skip_special_tokens=...)`.

Tokenizers whose decoder is not plain ByteLevel (SentencePiece-style Metaspace, WordPiece)
go through a slower windowed fallback that re-decodes a few trailing tokens per step; its
result equals a full decode for those decoders in the usual cases, but only the byte-level
path is exact by construction.
"""

from __future__ import annotations

import codecs
import functools

from tokenizers import Tokenizer, decoders


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte->printable-character table used by ByteLevel BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


class TokenBytes:
    """Raw bytes of every token id of a byte-level tokenizer, computed lazily and cached.

    Shared by all sequences of one tokenizer (build it once). A token whose text has a
    character outside the byte table (typically an added token such as `<｜User｜>`) stands
    for its own UTF-8 text, which is what the ByteLevel decoder does too.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self.special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self.is_byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.id_to_token(token_id)
            if text is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            table = _unicode_to_byte()
            try:
                cached = bytes(table[ch] for ch in text) if self.is_byte_level else text.encode()
            except KeyError:
                cached = text.encode()
            self._cache[token_id] = cached
        return cached


class IncrementalDetokenizer:
    """Feed the token ids of one sequence as they come; get text that is safe to show."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool, token_bytes: TokenBytes | None = None) -> None:
        self._tokenizer = tokenizer
        self._bytes = token_bytes or TokenBytes(tokenizer)
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # fallback path state (non byte-level decoders)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_chars_released = 0

    def add(self, token_ids: list[int] | tuple[int, ...]) -> str:
        if self._bytes.is_byte_level:
            data = b"".join(
                self._bytes(t) for t in token_ids if not (self._skip_special and t in self._bytes.special_ids)
            )
            return self._utf8.decode(data)
        return self._add_windowed(token_ids)

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        if self._bytes.is_byte_level:
            return self._utf8.decode(b"", final=True)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        rest = full[self._num_chars_released :]
        self._num_chars_released = len(full)
        return rest

    def _add_windowed(self, token_ids) -> str:
        self._ids.extend(token_ids)
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip_special)
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        released = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._num_chars_released += len(released)
        return released
