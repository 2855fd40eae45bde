"""Text prompt -> token ids at the gateway: the tokenizer's special tokens, and a sound lower
bound on a text's token count that is known before tokenizing it.

Special tokens. A completion prompt given as text gets what the checkpoint's tokenizer adds
around a text (for DeepSeek: BOS in front), as transformers and vLLM do; token-id prompts are
taken as given; the chat encoding writes its own BOS into the prompt text. What is added comes
from `tokenizer_config.json` when it says `add_bos_token` / `add_eos_token` (with `bos_token`
/ `eos_token` naming the tokens), else from tokenizer.json's post-processor (found by encoding
a probe text with and without it). Adding `prefix + ids + suffix` is what a template
post-processor does, so both sources give the same ids as `encode(text, add_special_tokens=True)`
when they agree.

Token lower bound. Refusing a prompt longer than the context needs its token count, and
tokenizing a 20 MiB text takes tens of seconds and gigabytes. For a byte-level BPE tokenizer
whose input text is not normalized and whose pre-tokenizers drop nothing, every byte of the
UTF-8 text is covered by exactly one token, and no token covers more bytes than the longest
entry of the vocabulary (a regular entry spells one byte per character; an added token covers
its content's UTF-8 bytes; an added token that strips neighbouring whitespace could cover any
number of bytes, so any such token voids the bound). Hence

    tokens(text) >= ceil(utf8_bytes(text) / max_bytes_per_token)

where an added token longer than every regular entry counts only when the text holds the
first character of one (an added token is matched on the raw text, and this bound applies
only when nothing normalizes it); one scan per distinct first character keeps this cheap.

(the prefix space a ByteLevel pre-tokenizer may add only raises the count). Any other
tokenizer (a normalizer that may shrink the text, an unknown-word model, a pre-tokenizer that
removes characters) gives no bound, and such prompts are tokenized before they are judged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

_PROBE_TEXT = "probe text 0"
_KEEPING_BEHAVIOURS = ("isolated", "merged_with_previous", "merged_with_next", "contiguous")


class TokenizerConfigError(ValueError):
    """tokenizer_config.json asks for a special token the tokenizer does not have."""


@dataclass(frozen=True)
class PromptTokens:
    """What `add_special_tokens` puts around a text, and the bound above (None: no bound)."""

    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()
    bound: TokenBytesBound | None = None

    @property
    def num_special_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.suffix_ids)

    def min_num_tokens(self, text: str, add_special_tokens: bool) -> int | None:
        """A lower bound on len(encode(text)), or None when the tokenizer gives none."""
        if self.bound is None:
            return None
        num_bytes = len(text) if text.isascii() else len(text.encode("utf-8"))
        num_special = self.num_special_tokens if add_special_tokens else 0
        return math.ceil(num_bytes / self.bound.max_bytes_per_token(text)) + num_special

    def encode(self, tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The ids of each text. The batch entry point releases the GIL while it tokenizes (the
        single-text `encode` holds it throughout), so long texts tokenized in a worker thread
        leave the event loop running."""
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        if add_special_tokens and (self.prefix_ids or self.suffix_ids):
            return [[*self.prefix_ids, *encoding.ids, *self.suffix_ids] for encoding in encodings]
        return [encoding.ids for encoding in encodings]


def prompt_tokens_for(tokenizer: Tokenizer, checkpoint_dir: str | Path | None = None) -> PromptTokens:
    """The checkpoint's rules: tokenizer_config.json (when it has one) over the post-processor."""
    config = _read_tokenizer_config(checkpoint_dir)
    prefix, suffix = _post_processor_tokens(tokenizer)
    if "add_bos_token" in config:
        prefix = _configured_token(tokenizer, config, "bos_token") if config["add_bos_token"] else ()
    if "add_eos_token" in config:
        suffix = _configured_token(tokenizer, config, "eos_token") if config["add_eos_token"] else ()
    return PromptTokens(prefix, suffix, token_bytes_bound(tokenizer))


def _read_tokenizer_config(checkpoint_dir: str | Path | None) -> dict:
    if checkpoint_dir is None:
        return {}
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerConfigError(f"{path}: cannot read: {error}") from None
    if not isinstance(config, dict):
        raise TokenizerConfigError(f"{path}: not a JSON object")
    return config


def _configured_token(tokenizer: Tokenizer, config: dict, key: str) -> tuple[int, ...]:
    token = config.get(key)
    if isinstance(token, dict):  # a serialized AddedToken
        token = token.get("content")
    token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if token_id is None:
        flag = "add_bos_token" if key == "bos_token" else "add_eos_token"
        raise TokenizerConfigError(f"tokenizer_config.json: {flag} is true but {key} {token!r} is not a token "
                                   f"of tokenizer.json")
    return (token_id,)


def _post_processor_tokens(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix) that tokenizer.json's post-processor adds around a single text."""
    plain = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE_TEXT, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain):])
    raise TokenizerConfigError("tokenizer.json: the post_processor changes the text's own tokens; only added "
                               "tokens around the text are supported")


@dataclass(frozen=True)
class TokenBytesBound:
    """The most UTF-8 bytes one token covers: a regular vocabulary entry, or an added token."""

    max_regular_bytes: int
    max_added_bytes: int
    long_added_first_chars: frozenset[str]  # first characters of added tokens above max_regular_bytes

    def max_bytes_per_token(self, text: str) -> int:
        if any(c in text for c in self.long_added_first_chars):
            return max(self.max_regular_bytes, self.max_added_bytes)
        return self.max_regular_bytes


def token_bytes_bound(tokenizer: Tokenizer) -> TokenBytesBound | None:
    """How many UTF-8 bytes one token can cover, when the tokenizer guarantees a bound (see
    the module docstring), else None."""
    spec = json.loads(tokenizer.to_str())
    if (spec.get("model") or {}).get("type") != "BPE" or spec.get("normalizer") is not None:
        return None
    if not _byte_level_keeping_every_byte(spec.get("pre_tokenizer")):
        return None
    added = tokenizer.get_added_tokens_decoder()
    if any(token.lstrip or token.rstrip for token in added.values()):
        return None
    added_ids = set(added)
    longest_regular = max((len(token) for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items()
                           if token_id not in added_ids), default=1)
    added_sizes = {token.content: len(token.content.encode("utf-8")) for token in added.values() if token.content}
    longest_regular = max(longest_regular, 1)
    first_chars = frozenset(text[0] for text, size in added_sizes.items() if size > longest_regular)
    return TokenBytesBound(longest_regular, max(added_sizes.values(), default=1), first_chars)


def _byte_level_keeping_every_byte(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    has_byte_level = False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            has_byte_level = True
        elif kind in ("Split", "Punctuation"):
            if _snake(str(step.get("behavior", "isolated"))) not in _KEEPING_BEHAVIOURS:
                return False
        elif kind != "Digits":
            return False  # Whitespace, Metaspace, ... drop or rewrite characters
    return has_byte_level


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
