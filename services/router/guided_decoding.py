"""Constrained decoding and logit bias, the router's side: request fields -> per-step token masks.

`response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}})
is compiled by llguidance into a grammar when the request is parsed (a schema it refuses is
a 400 naming response_format). Each constrained sequence then owns a `TokenGuide`: one
llguidance matcher that follows the tokens the scheduler commits. Before every step that
samples it, the guide gives the packed allowed-token bitmask of each position the attention
worker will sample: one row for plain decoding; 1 + W rows under speculative verification,
where the matcher walks the W drafts speculatively (stopping at the first draft the grammar
refuses: verification rejects it, so the rows after it are never used) and rolls back.
`attach_token_masks` puts the rows of a step into `StepPlan.token_masks` (one int32 numpy
array, one tensor frame); the worker applies them before sampling and verification
(services/attention/sampling/token_masks.py). The scheduler advances the guide by exactly the
tokens it appends (`TokenGuide.advance`, called from stop_checks.py) and ends the request
with finish_reason "stop" once the grammar is complete.

`logit_bias` is validated here (token ids of the vocabulary, biases in [-100, 100]) and travels
in SamplingParams; the worker's sampler adds it to the raw logits.

No torch here: masks are numpy int32 words, filled by llguidance's Rust code per row (no
Python loop over the vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moemesh.common.wire.messages import StepPlan
from moemesh.services.router.protocol import ProtocolError
from moemesh.services.router.scheduler.request import FinishReason

MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
_FORMAT_TYPES = ("text", "json_object", "json_schema")
# json_object: any JSON object, as OpenAI and vLLM define that mode
_JSON_OBJECT_SCHEMA = {"type": "object"}
# Compact JSON (no free whitespace between tokens of the syntax): a model cannot pad the output
# with blank lines until max_tokens. A schema may override it with its own "x-guidance" options.
_JSON_DEFAULTS = {"whitespace_flexible": False}


def parse_logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map -> sorted (token id, bias) pairs; 400 naming logit_bias."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ProtocolError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ProtocolError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
    pairs = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {key!r:.40}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise ProtocolError(f"'logit_bias' token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ProtocolError(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r:.40} "
                                f"for token {token_id}", param="logit_bias")
        if token_id in pairs:
            raise ProtocolError(f"'logit_bias' names token id {token_id} twice", param="logit_bias")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class ResponseFormat:
    """A parsed response_format that constrains decoding: kind and its llguidance grammar."""

    kind: str  # "json_object" | "json_schema"
    grammar: str  # llguidance's serialized grammar
    name: str | None = None  # json_schema.name


def _format_error(message: str) -> ProtocolError:
    return ProtocolError(message, param="response_format")


def parse_response_format(value: Any) -> ResponseFormat | None:
    """The body's response_format -> None (absent or text) or a compiled grammar; 400 naming it."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in _FORMAT_TYPES:
        raise _format_error(f"'response_format' must be an object with type one of {', '.join(_FORMAT_TYPES)}")
    kind = value["type"]
    if kind == "text":
        return None
    from llguidance import LLMatcher  # imported by the first request that asks for a grammar

    name = None
    if kind == "json_object":
        schema = _JSON_OBJECT_SCHEMA
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _format_error("'response_format.json_schema' must be an object {name, schema, strict}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise _format_error("'response_format.json_schema.name' must be a non-empty string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise _format_error("'response_format.json_schema.strict' must be a boolean")
        schema = spec.get("schema", {})
        if schema is True:  # the boolean schema that accepts any JSON value
            schema = {}
        if not isinstance(schema, dict):
            raise _format_error("'response_format.json_schema.schema' must be a JSON Schema object")
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
        problem = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as error:
        problem = str(error)
    if problem:
        raise _format_error(f"'response_format' schema is not supported: {problem[:300]}")
    return ResponseFormat(kind, grammar, name)


class GrammarTokenizer:
    """The llguidance view of the router's tokenizer, built on first use (a vocabulary scan)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._built = None

    def get(self):
        if self._built is None:
            from llguidance import LLTokenizer

            self._built = LLTokenizer(self._tokenizer.to_str(), eos_token=self._eos_token_ids or None)
        return self._built

    def new_guide(self, response_format: ResponseFormat, start_after_token_id: int | None = None) -> "TokenGuide":
        return TokenGuide(self.get(), response_format.grammar, start_after_token_id)


class TokenGuide:
    """One constrained sequence's grammar state (a matcher over the tokens committed so far).

    `start_after_token_id`: the grammar applies only after this token (a chat answer that
    thinks first is constrained after its end-of-thinking token, as vLLM's reasoning models
    are); None: from the first generated token.
    """

    def __init__(self, ll_tokenizer: Any, grammar: str, start_after_token_id: int | None = None) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)  # refusals are reported by advance()
        if self.matcher.is_error():
            raise _format_error(f"'response_format' grammar failed to start: {self.matcher.get_error()[:300]}")
        self.num_words = -(-ll_tokenizer.vocab_size // 32)
        self.start_after_token_id = start_after_token_id
        self.started = start_after_token_id is None

    def masks(self, draft_token_ids: Sequence[int] = ()) -> np.ndarray | None:
        """[1 + W, words] int32: the allowed tokens at the next position and after each draft;
        None while the grammar has not started and no draft starts it. Rows before the start,
        after a draft the grammar refuses and after the grammar completes allow everything:
        the first are unconstrained, and verification never samples from the others."""
        from llguidance.numpy import fill_next_token_bitmask

        start = 0 if self.started else next(
            (k + 1 for k, token_id in enumerate(draft_token_ids) if token_id == self.start_after_token_id), None)
        if start is None:
            return None
        rows = np.full((1 + len(draft_token_ids), self.num_words), -1, dtype=np.int32)
        fill_next_token_bitmask(self.matcher, rows, start)
        num_consumed = 0
        for k in range(start, len(draft_token_ids)):
            token_id = draft_token_ids[k]
            allowed = 0 <= token_id < 32 * self.num_words and (int(rows[k, token_id >> 5]) >> (token_id & 31)) & 1
            if not allowed or not self.matcher.consume_token(token_id):
                break
            num_consumed += 1
            if self.matcher.is_stopped():
                break
            fill_next_token_bitmask(self.matcher, rows, k + 1)
        if num_consumed:
            self.matcher.rollback(num_consumed)
        return rows

    def advance(self, token_id: int) -> FinishReason | None:
        """Commit one token: STOP once the grammar is complete, ERROR for a token it refuses
        (the worker did not apply the mask), None while it goes on."""
        if not self.started:
            self.started = token_id == self.start_after_token_id
            return None
        if not self.matcher.consume_token(token_id):
            return FinishReason.ERROR
        return FinishReason.STOP if self.matcher.is_stopped() else None


def attach_token_masks(plan: StepPlan, guide_of: Callable[[str], TokenGuide | None]) -> StepPlan:
    """The plan with the masks of every constrained sampled sequence (after drafts are set)."""
    sequences, blocks, num_rows = [], [], 0
    for seq in plan.sequences:
        guide = guide_of(seq.request_id) if seq.do_sample else None
        if guide is None:
            sequences.append(seq)
            continue
        rows = guide.masks(seq.draft_token_ids)  # [1 + W, words]
        if rows is None:
            sequences.append(seq)
            continue
        sequences.append(dataclasses.replace(seq, token_mask_row=num_rows))
        blocks.append(rows)
        num_rows += rows.shape[0]
    if not blocks:
        return plan
    return dataclasses.replace(plan, sequences=tuple(sequences), token_masks=np.concatenate(blocks))
